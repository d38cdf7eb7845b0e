"""Groups on a real server (the committed ``pipeline`` over the real models): every request of a
burst gets exactly its own rows, each member of a group keeps its deadline and its
cancellation, and the groups show in the metrics."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bls_models import pipelines
from bls_models import spec as S
from modelgen import export
from tests.helpers import (
    SLACK,
    STATUS,
    assert_served,
    batch_spread,
    eventually,
    image,
    metric,
    request_inputs,
    settled,
)

COALESCED = "pipeline"  # as committed
DISTINCT = 50  # distinct images, cycled over the burst: neighbours in a group always differ


@pytest.fixture(scope="module")
def expected(repository):
    """Per distinct image: what the pipeline computes, in-process on the same ONNX files, and
    the spread batching allows (zero on this host)."""
    sessions = {m.name: ort.InferenceSession(str(export.onnx_path(repository, m)),
                                             providers=["CPUExecutionProvider"])
                for m in (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER)}

    def pipeline(images):
        (pixels,) = sessions["preprocess"].run(None, {"IMAGE": images})
        (logits,) = sessions["classifier"].run(None, {"PIXELS": pixels})
        (embedding,) = sessions["embedder"].run(None, {"PIXELS": pixels})
        ids, probs = pipelines.softmax_top_k(logits)
        return [ids, probs, embedding]

    images = np.concatenate([image(seed=100 + i) for i in range(DISTINCT)])
    ids, probs, embedding = pipeline(images)
    spreads = batch_spread(pipeline, images[:4], S.CLASSIFIER.max_batch_size)
    return images, {"CLASS_IDS": ids, "CLASS_PROBS": probs, "EMBEDDING": embedding}, spreads


def check(result, index: int, expected) -> None:
    _, values, spreads = expected
    row = index % DISTINCT
    np.testing.assert_array_equal(result.as_numpy("CLASS_IDS"), values["CLASS_IDS"][row:row + 1])
    assert_served(result.as_numpy("CLASS_PROBS"), values["CLASS_PROBS"][row:row + 1], spreads[1],
                  "CLASS_PROBS")
    assert_served(result.as_numpy("EMBEDDING"), values["EMBEDDING"][row:row + 1], spreads[2],
                  "EMBEDDING")


def test_a_burst_of_600_over_grpc_each_gets_exactly_its_own_rows(server, expected):
    images = expected[0]

    async def burst():
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            async def one(i):
                data = images[i % DISTINCT:i % DISTINCT + 1]
                return await client.infer(COALESCED, request_inputs(grpcaio, "IMAGE", data, "UINT8"),
                                          request_id=f"burst-{i}", timeout=120_000_000)
            return await asyncio.gather(*(one(i) for i in range(600)), return_exceptions=True)
        finally:
            await client.close()

    labels = {"model": COALESCED, "stage": "classifier"}
    before = settled(server, "bls_subrequest_rows_count", **labels)
    rows_before = settled(server, "bls_subrequest_rows_sum", **labels)
    results = asyncio.run(burst())
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    for i, result in enumerate(results):
        assert result.get_response().id == f"burst-{i}"  # request ids kept per request
        check(result, i, expected)
    # The histogram counts each request's row in exactly one classifier sub-request.
    rows = eventually(server, "bls_subrequest_rows_sum", rows_before + 600, **labels)
    assert rows - rows_before == 600
    groups = metric(server, "bls_subrequest_rows_count", **labels) - before
    assert 0 < groups < 600, "the burst was not grouped"


def test_a_burst_over_http_each_gets_exactly_its_own_rows(server, expected):
    images = expected[0]
    client = httpclient.InferenceServerClient(server.http_url, concurrency=64,
                                              network_timeout=120)
    try:
        pending = []
        for i in range(256):
            data = images[i % DISTINCT:i % DISTINCT + 1]
            pending.append(client.async_infer(COALESCED, request_inputs(httpclient, "IMAGE", data,
                                                                        "UINT8")))
        for i, request in enumerate(pending):
            check(request.get_result(), i, expected)
    finally:
        client.close()


def _together(server, protocol: str, model: str, datas, timeouts=None) -> list[object]:
    """One request per array, all in flight at once (gRPC aio or HTTP async); results or
    InferenceServerExceptions, in order."""
    timeouts = timeouts or [None] * len(datas)
    if protocol == "grpc":
        async def send():
            client = grpcaio.InferenceServerClient(server.grpc_url)
            try:
                return await asyncio.gather(*(
                    client.infer(model, request_inputs(grpcaio, "IMAGE", d, "UINT8"),
                                 **({"timeout": t} if t else {}))
                    for d, t in zip(datas, timeouts)), return_exceptions=True)
            finally:
                await client.close()
        return asyncio.run(send())
    client = httpclient.InferenceServerClient(server.http_url, concurrency=len(datas))
    try:
        pending = [client.async_infer(model, request_inputs(httpclient, "IMAGE", d, "UINT8"),
                                      **({"timeout": t} if t else {}))
                   for d, t in zip(datas, timeouts)]
        outcomes = []
        for request in pending:
            try:
                outcomes.append(request.get_result())
            except InferenceServerException as error:
                outcomes.append(error)
        return outcomes
    finally:
        client.close()


def test_short_and_long_deadlines_in_one_group(server, expected):
    """Ten requests together; two may take 5 ms (less than the group's first stage takes here:
    30 ms was once met under load), the rest 30 s. The short ones are answered with the deadline
    error, the long ones succeed."""
    images = expected[0]
    timeouts = [5_000 if i in (3, 7) else 30_000_000 for i in range(10)]
    started = time.monotonic()
    outcomes = _together(server, "grpc", COALESCED, [images[i:i + 1] for i in range(10)],
                         timeouts)
    elapsed = time.monotonic() - started
    for i, outcome in enumerate(outcomes):
        if i in (3, 7):
            assert isinstance(outcome, InferenceServerException), outcome
            assert outcome.status() == STATUS["grpc"]["UNAVAILABLE"], outcome
        else:
            assert not isinstance(outcome, Exception), outcome
            check(outcome, i, expected)
    assert elapsed < 30 + SLACK


def test_a_cancelled_member_is_answered_cancelled_once_and_its_group_finishes(server, expected):
    """A burst with one request the client cancels while it is in flight."""
    images = expected[0]
    before = settled(server, "bls_cancelled_requests_total", model=COALESCED)

    async def scenario():
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            tasks = [asyncio.ensure_future(client.infer(
                COALESCED, request_inputs(grpcaio, "IMAGE", images[i:i + 1], "UINT8")))
                for i in range(40)]
            await asyncio.sleep(0.05)
            tasks[5].cancel()  # the gRPC aio client cancels the call on the server
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await client.close()

    outcomes = asyncio.run(scenario())
    assert isinstance(outcomes[5], asyncio.CancelledError)
    for i, outcome in enumerate(outcomes):
        if i != 5:
            assert not isinstance(outcome, BaseException), outcome
            check(outcome, i, expected)
    # Counted once, if the orchestrator saw the cancellation before its last stage (it may
    # also have finished first: then it was answered, and Triton dropped the answer).
    after = eventually(server, "bls_cancelled_requests_total", lambda v: v - before <= 1,
                       model=COALESCED)
    assert after - before in (0, 1)
