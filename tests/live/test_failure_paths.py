"""Failure paths against the real server, over HTTP and gRPC: a sick stage, overload with
deadlines, and a user's pipeline with bugs (issue 20: every request answered exactly once,
whatever fails).

* A sick stage: ``pipeline_sick``'s embedder (``fault_sick``) fails every request with an error
  no item causes, under 64 concurrent requests. Every client gets the stage's error promptly,
  and the sub-model gets at most 1.5 sub-requests per client request (Triton's own count of
  what it received: ``nv_inference_request_success`` + ``_failure``).
* Overload: 256 concurrent requests of 150 KB with 500 ms deadlines against
  ``pipeline_overload`` whose classifier takes 2 s. Each instance runs one batch at a time, so
  the few requests that reach ``execute`` get the orchestrator's deadline error (returned or
  sent on time while ``execute`` still waits on the classifier) and the rest expire in Triton's queue
  of the orchestrator (its queue policy: "Request timeout expired"). At the client every answer
  is UNAVAILABLE: the orchestrator's within the deadline + ``HARD_SLACK`` (the on-time promise's
  "always"), the queue's within the deadline + ``QUEUE_SWEEP``, each plus what the burst's 38 MB
  take to reach the server (gRPC frontend; ``INGEST_SLACK``), which no orchestrator can shorten.
* A pipeline written as docs/extending.md shows, whose run function leaves a declared output
  out for one input and raises for another: both answered INTERNAL within the deadline with no
  exception text, and the server stops on Ctrl-C at once afterwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from bls_models.triton_runtime import SHUTDOWN_DRAIN_SECONDS
from reliability.accounting import TRITON_QUEUE_TIMEOUT
from tests.helpers import (
    HARD_SLACK,
    STATUS,
    eventually,
    image,
    metric,
    request_inputs,
    server_options,
    settled,
    timed_infer,
)
from tritonlocal import TritonServer

SICK = "CUDA error: an illegal memory access was encountered"  # no item causes that


def received(server, model: str) -> float:
    """Requests Triton handed ``model`` (each sub-request is one, whatever its rows)."""
    return (metric(server, "nv_inference_request_success", model=model)
            + metric(server, "nv_inference_request_failure", model=model))


def concurrently(count: int, send) -> list:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(send, range(count)))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_sick_stage_fails_every_request_promptly_and_is_not_hammered(server, fault_repository,
                                                                       protocol):
    error_file = fault_repository / "fault_sick" / "error"
    data = image(3)
    url = server.http_url if protocol == "http" else server.grpc_url
    module = httpclient if protocol == "http" else grpcclient
    before = received(server, "fault_sick")
    error_file.write_text(SICK)
    try:
        def send(i: int):
            client = module.InferenceServerClient(url)
            try:
                return timed_infer(client, protocol, "pipeline_sick", data, request_id=f"sick-{i}")
            finally:
                client.close()

        outcomes = concurrently(64, send)
    finally:
        error_file.unlink()
    for outcome in outcomes:
        assert outcome.error is not None, "a request of a sick stage succeeded"
        assert outcome.error.status() == STATUS[protocol]["INTERNAL"]
        assert "stage 'embedder'" in outcome.error.message()
        assert SICK in outcome.error.message()
    slowest = max(o.elapsed for o in outcomes)
    assert slowest < 3.0, f"the slowest client waited {slowest:.2f} s for a stage that fails at once"
    time.sleep(1.0)  # Triton's statistics lag a little
    sub_requests = received(server, "fault_sick") - before
    assert 0 < sub_requests <= 1.5 * 64, f"{sub_requests} sub-requests for 64 client requests"


# What reaching the server may add to a request of a 256 x 150 KB gRPC burst at the client:
# measured 0.32-0.65 s for the last request on this 2-core host with a busy loop on one core
# (2026-11-26; without it, about 0.15 s), while the orchestrator answered each within 25 ms of
# its deadline counted from its arrival.
INGEST_SLACK = 0.5
# r24.10 rejects an expired request in a model's queue when its batcher forms a batch, or in a
# sweep of the queue after 500 ms in which no instance came free (core dynamic_batch_scheduler.cc):
# with every instance busy, up to this long after its timeout (docs/orchestrator.md).
QUEUE_SWEEP = 0.5


def test_overload_with_deadlines_is_answered_on_time(server):
    """256 concurrent gRPC requests, 500 ms deadlines, 2 instances running one batch each, a
    classifier of 2 s (after a warm-up burst: the stand-in stubs' first large responses grow
    their shared memory)."""
    model, deadline = "pipeline_overload", 0.5
    data = image(4)

    async def load(tag: str, delay: str):
        client = grpcaio.InferenceServerClient(server.grpc_url)

        async def one(i: int):
            started = time.monotonic()
            try:
                await client.infer(model, request_inputs(grpcaio, "IMAGE", data, "UINT8"),
                                   request_id=f"{tag}-{i};{delay}",
                                   timeout=int(deadline * 1e6), client_timeout=30)
                return time.monotonic() - started, None
            except InferenceServerException as error:
                return time.monotonic() - started, error

        try:
            return await asyncio.gather(*(one(i) for i in range(256)))
        finally:
            await client.close()

    asyncio.run(load("warm-up", "no-delay"))
    executed_before = settled(server, "bls_requests_total", model=model)
    answers = asyncio.run(load("overload", "fault_classifier:delay:2000"))
    assert all(error is not None for _, error in answers), "a 2 s classifier met a 500 ms deadline"
    assert all(error.status() == STATUS["grpc"]["UNAVAILABLE"] for _, error in answers), \
        {error.message() for _, error in answers if error.status() != "StatusCode.UNAVAILABLE"}
    # Who answered: the orchestrator, at the deadline of a request that reached execute, or
    # Triton's queue policy, for one still queued when its timeout passed.
    by = {"orchestrator": [], "queue": []}
    for seconds, error in answers:
        message = error.message()
        kind = ("orchestrator" if "deadline exceeded in stage 'classifier'" in message
                else "queue" if TRITON_QUEUE_TIMEOUT in message else message)
        by.setdefault(kind, []).append(seconds)
    assert set(by) == {"orchestrator", "queue"}, set(by)
    assert by["orchestrator"], "no request reached execute: the orchestrator's timekeeping was not tested"
    assert by["queue"], "every request reached execute: Triton's queue was not tested"
    # Every request that reached execute was answered there, once.
    executed = eventually(server, "bls_requests_total",
                          lambda v: v - executed_before >= len(by["orchestrator"]), model=model)
    assert executed - executed_before == len(by["orchestrator"]), (executed, executed_before)
    elapsed = sorted(seconds for seconds, _ in answers)
    summary = (f"256 answers after {elapsed[0]:.3f}-{elapsed[-1]:.3f} s, median "
               f"{statistics.median(elapsed):.3f} s, p90 {elapsed[int(0.9 * len(elapsed))]:.3f} s; "
               + "; ".join(f"{len(times)} by the {kind}, {min(times):.3f}-{max(times):.3f} s"
                           for kind, times in by.items()))
    print(summary)
    assert max(by["orchestrator"]) < deadline + HARD_SLACK + INGEST_SLACK, summary
    assert max(by["queue"]) < deadline + QUEUE_SWEEP + INGEST_SLACK, summary


# -- a user's pipeline with bugs ----------------------------------------------------------------
BUGS = '''
async def run(inputs, call, setup):
    image = inputs[S.IMAGE.name]
    outputs = await _run(inputs, call, setup)
    rows = image.reshape(len(image), -1)  # a group's rows may hold other requests' images
    if (rows == 7).all(axis=1).any():
        del outputs[NORM.name]  # a data-dependent bug: this kind of image gets no NORM
    if (rows == 9).all(axis=1).any():
        raise ZeroDivisionError("secret detail of the bug")
    return outputs
'''


def buggy_model_py() -> str:
    """The page's model.py, whose run function leaves NORM out for one kind of image and raises
    for another (bugs the config command's contract check, run on zeros, cannot see)."""
    from tests.helpers import page_model_py

    text = page_model_py().replace("async def run(inputs, call, setup):",
                                   "async def _run(inputs, call, setup):", 1)
    anchor = "\n\nIMAGE_EMBEDDING = PipelineDef("
    return text.replace(anchor, "\n" + BUGS + anchor, 1)


def test_a_pipeline_with_bugs_answers_internal_on_time_and_stops_at_once(repository, tmp_path):
    from tests.helpers import EXTENDING_NAME as NAME
    from tests.helpers import extending_checkout

    # The config command's contract check passes: zeros are fine.
    repo = extending_checkout(tmp_path, repository, buggy_model_py())
    server = TritonServer(server_options(repo, tmp_path))
    server.start()
    try:
        http = httpclient.InferenceServerClient(server.http_url, network_timeout=30)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        for value in (7, 9):
            data = np.full((1, *S.IMAGE.dims), value, np.uint8)
            for protocol, client in (("http", http), ("grpc", grpc)):
                outcome = timed_infer(client, protocol, NAME, data, request_id=f"bug-{value}")
                assert outcome.error is not None, (protocol, value)
                assert outcome.error.status() == STATUS[protocol]["INTERNAL"], outcome.error
                assert outcome.elapsed < 2.0, (protocol, value, outcome.elapsed)
                message = outcome.error.message()
                assert "internal error in orchestrator" in message
                assert not any(text in message for text in ("ZeroDivisionError", "secret",
                                                            "KeyError", "Traceback")), message
        ok = timed_infer(grpc, "grpc", NAME, image(1))
        assert ok.error is None, ok.error
        assert settled(server, "bls_requests_total", model=NAME, code="INTERNAL") == 4
        http.close()
        grpc.close()
    finally:
        started = time.monotonic()
        server.stop()
        stopping = time.monotonic() - started
    # A clean stop takes about 4 s here (5.1 s once on a loaded host); a request or thread the
    # bugs left stuck would hold finalize for its whole drain (SHUTDOWN_DRAIN_SECONDS, 10 s).
    assert stopping < SHUTDOWN_DRAIN_SECONDS - 2, \
        f"the server took {stopping:.1f} s to stop after the bugs"
