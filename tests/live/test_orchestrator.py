"""How the BLS orchestrators behave under slow, failing and crashing sub-models, cancellation and
load — against the real server, with the test-only fault models (modelgen/fault_model.py, modelgen/variants.py).

The only timing assertions are behaviour the orchestrator promises: an error within the deadline
plus 50 ms, and unrelated requests not waiting for a slow one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bls_models import spec as S
from tests.live.support import (STATUS, drive, image, inference_count, metric, request_inputs,
                                timed_infer)

DEADLINE_SLACK = 0.05  # the promise: an error within deadline + 50 ms


@pytest.fixture
def client_for(http_client, grpc_client):
    return lambda protocol: http_client if protocol == "http" else grpc_client


def assert_error(outcome, protocol: str, code: str, *fragments: str) -> None:
    assert outcome.error is not None, "expected an error, got a result"
    assert outcome.error.status() == STATUS[protocol][code], str(outcome.error)
    message = outcome.error.message()
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "Traceback" not in message


# -- concurrency ----------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_slow_request_does_not_hold_up_fifty_others(protocol, server):
    """Requests stuck 1 s in a slow sub-model; 50 unrelated requests still finish promptly.

    As many slow requests as the orchestrator has instances: a design that serialises requests
    per instance (a non-decoupled async execute, or gathering a batch per execute) then has
    every instance blocked, and the 50 would wait for the slow ones.
    """
    import tritonclient.http as httpclient

    instances = S.PIPELINE.instance_count  # pipeline_faulty is a variant of pipeline

    def make_client():
        if protocol == "http":
            return httpclient.InferenceServerClient(server.http_url, concurrency=64,
                                                    network_timeout=60)
        return grpcclient.InferenceServerClient(server.grpc_url)

    pool = concurrent.futures.ThreadPoolExecutor(50 + instances)
    clients = [make_client() for _ in range(50 + instances)]
    try:
        slow = []
        for i in range(instances):
            slow.append(pool.submit(timed_infer, clients[i], protocol, "pipeline_faulty", image(i),
                                    request_id=f"slow-{i};fault_classifier:delay:1000"))
            time.sleep(0.1)  # each slow request is inside the orchestrator before the next
        others = [pool.submit(timed_infer, clients[instances + i], protocol, "pipeline_faulty",
                              image(i), request_id=f"fast-{i}") for i in range(50)]
        fast = [future.result(timeout=60) for future in others]
        slow_outcomes = [future.result(timeout=60) for future in slow]
    finally:
        pool.shutdown()
        for client in clients:
            client.close()
    assert all(o.error is None and o.elapsed >= 1.0 for o in slow_outcomes)
    assert all(o.error is None for o in fast), [str(o.error) for o in fast if o.error]
    latencies = sorted(o.elapsed for o in fast)
    # Serialised behind the slow requests, they would take 0.8 s or more.
    assert latencies[-1] < 0.8, f"slowest of 50: {latencies[-1]:.3f} s (p50 {latencies[25]:.3f} s)"


# -- deadlines ------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model, stage, data, name, dtype", [
    ("pipeline_faulty", "preprocess", image(2), "IMAGE", "UINT8"),
    ("pipeline_faulty", "classifier", image(3), "IMAGE", "UINT8"),
    ("pipeline_faulty", "embedder", image(4), "IMAGE", "UINT8"),
    ("tag_pipeline_faulty", "tagger", np.zeros((1, S.TAGGER_SEQ_LEN), np.int64), "TOKENS", "INT64"),
])
def test_client_deadline_expires_in_each_stage(model, stage, data, name, dtype, protocol,
                                               client_for, server):
    budget = 0.3
    outcome = timed_infer(client_for(protocol), protocol, model, data, name=name, dtype=dtype,
                          request_id=f"fault_{stage}:delay:{int(budget * 1000) + 500}",
                          timeout_us=int(budget * 1e6))
    assert_error(outcome, protocol, "UNAVAILABLE", "deadline", f"'{stage}'", f"fault_{stage}")
    assert outcome.elapsed < budget + DEADLINE_SLACK, f"answered after {outcome.elapsed:.3f} s"


def test_default_deadline_applies_without_a_client_timeout(grpc_client):
    # pipeline_faulty: default_deadline_ms = 1500
    outcome = timed_infer(grpc_client, "grpc", "pipeline_faulty", image(5),
                          request_id="fault_classifier:delay:2000")
    assert_error(outcome, "grpc", "UNAVAILABLE", "deadline", "'classifier'", "default deadline")
    assert 1.5 <= outcome.elapsed < 1.5 + DEADLINE_SLACK


def test_stage_timeout_caps_one_stage(grpc_client):
    # pipeline_faulty: embedder_timeout_ms = 400; the client allows 5 s.
    outcome = timed_infer(grpc_client, "grpc", "pipeline_faulty", image(6),
                          request_id="fault_embedder:delay:1000", timeout_us=5_000_000)
    assert_error(outcome, "grpc", "UNAVAILABLE", "deadline", "'embedder'", "stage timeout")
    assert 0.4 <= outcome.elapsed < 0.4 + DEADLINE_SLACK


def test_abandoned_sub_requests_are_counted_and_complete(grpc_client, server):
    labels = {"model": "pipeline_faulty", "stage": "classifier"}

    def settled() -> tuple[float, float]:
        """Counters once earlier tests' abandoned sub-requests have all finished."""
        give_up = time.monotonic() + 10
        while True:
            counts = (metric(server, "bls_abandoned_subrequests_total", **labels),
                      metric(server, "bls_abandoned_subrequests_completed_total", **labels))
            if counts[0] == counts[1] or time.monotonic() > give_up:
                return counts
            time.sleep(0.1)

    abandoned, completed = settled()
    assert abandoned == completed, "abandoned sub-requests that never complete"
    outcome = timed_infer(grpc_client, "grpc", "pipeline_faulty", image(7),
                          request_id="fault_classifier:delay:600", timeout_us=200_000)
    assert_error(outcome, "grpc", "UNAVAILABLE", "deadline")
    assert metric(server, "bls_abandoned_subrequests_total", **labels) == abandoned + 1
    # The sub-model finishes the abandoned work (its result is dropped) and it is counted.
    assert settled() == (abandoned + 1, completed + 1)
    assert timed_infer(grpc_client, "grpc", "pipeline_faulty", image(8)).error is None


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_failing_sub_model_gives_internal_naming_stage_and_model(protocol, client_for):
    outcome = timed_infer(client_for(protocol), protocol, "pipeline_faulty", image(9),
                          request_id="fault_embedder:error:disk on fire")
    assert_error(outcome, protocol, "INTERNAL", "'embedder'", "'fault_embedder'", "disk on fire")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_out_of_range_tokens_are_invalid_argument(protocol, client_for, grpc_client):
    tokens = np.zeros((1, S.TAGGER_SEQ_LEN), np.int64)
    tokens[0, 10] = S.TAGGER_VOCAB
    stage_model = S.TAG_PIPELINE.parameters["tagger_model"]
    before = inference_count(grpc_client, stage_model)
    outcome = timed_infer(client_for(protocol), protocol, "tag_pipeline", tokens, name="TOKENS",
                          dtype="INT64")
    assert_error(outcome, protocol, "INVALID_ARG", "TOKENS", str(S.TAGGER_VOCAB))
    assert inference_count(grpc_client, stage_model) == before, "a bad request reached the tagger"


def test_one_bad_request_fails_alone(server):
    """Requests arriving together may share an execute(); each is answered on its own."""
    good = np.random.default_rng(0).integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN))
    bad = good.copy()
    bad[0, 0] = -3
    payloads = [good, good, bad, good]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = {}
    try:
        for i, data in enumerate(payloads):
            client.async_infer("tag_pipeline", request_inputs(grpcclient, "TOKENS", data, "INT64"),
                               callback=lambda result, error, i=i: results.__setitem__(i, (result, error)),
                               request_id=f"batch-{i}")
        deadline = time.monotonic() + 30
        while len(results) < len(payloads) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        client.close()
    assert sorted(results) == [0, 1, 2, 3]
    for i, (result, error) in results.items():
        if i == 2:
            assert error is not None and error.status() == "StatusCode.INVALID_ARGUMENT"
        else:
            assert error is None and result.as_numpy("TAGS").shape == (1, S.TAGGER_SEQ_LEN)


def test_a_full_sub_model_queue_is_unavailable(server):
    """fault_queue has one instance and room for 2 queued requests."""
    pool = concurrent.futures.ThreadPoolExecutor(8)
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(8)]
    try:
        busy = pool.submit(timed_infer, clients[0], "grpc", "pipeline_queue", image(1),
                           request_id="fault_queue:delay:1000")
        time.sleep(0.3)
        burst = [pool.submit(timed_infer, clients[i], "grpc", "pipeline_queue", image(i))
                 for i in range(1, 8)]
        outcomes = [f.result(timeout=30) for f in burst]
        assert busy.result(timeout=30).error is None
    finally:
        pool.shutdown()
        for client in clients:
            client.close()
    rejected = [o for o in outcomes if o.error is not None]
    assert len(rejected) >= 4, "7 requests cannot fit a queue of 2"
    for outcome in rejected:
        assert_error(outcome, "grpc", "UNAVAILABLE", "'classifier'", "queue")
        assert outcome.elapsed < 0.5, "queue-full must be refused at once"
    assert any(o.error is None for o in outcomes), "admitted requests must still succeed"


def test_a_crashed_sub_model_gives_an_error_not_a_hang(grpc_client):
    # pipeline_crash: classifier -> fault_crash (its only instance dies); default deadline 3 s.
    outcome = timed_infer(grpc_client, "grpc", "pipeline_crash", image(10),
                          request_id="fault_crash:crash")
    assert outcome.error is not None
    assert outcome.error.status() in (STATUS["grpc"]["INTERNAL"], STATUS["grpc"]["UNAVAILABLE"])
    assert "'classifier'" in outcome.error.message()
    assert outcome.elapsed < 3.0 + DEADLINE_SLACK
    # The orchestrator and the rest of the server carry on.
    again = timed_infer(grpc_client, "grpc", "pipeline_crash", image(11))
    assert again.error is not None and "'classifier'" in again.error.message()
    assert timed_infer(grpc_client, "grpc", "pipeline", image(12)).error is None


# -- cancellation ---------------------------------------------------------------------------------
def test_a_cancelled_request_stops_before_the_next_stage(server, grpc_client):
    before = inference_count(grpc_client, "fault_classifier")
    cancelled = metric(server, "bls_cancelled_requests_total", model="pipeline_faulty")
    answered = metric(server, "bls_requests_total", model="pipeline_faulty", code="CANCELLED")
    # The gRPC deadline (client_timeout) cancels the request while preprocess takes 0.8 s.
    outcome = timed_infer(grpc_client, "grpc", "pipeline_faulty", image(13),
                          request_id="fault_preprocess:delay:800", client_timeout=0.3)
    assert outcome.error is not None and "Deadline" in str(outcome.error)
    time.sleep(1.0)  # preprocess finishes; the orchestrator must then stop
    assert metric(server, "bls_cancelled_requests_total", model="pipeline_faulty") > cancelled
    assert metric(server, "bls_requests_total", model="pipeline_faulty",
                  code="CANCELLED") == answered + 1, "answered exactly once, as CANCELLED"
    assert inference_count(grpc_client, "fault_classifier") == before, "classifier was still called"


# -- load -----------------------------------------------------------------------------------------
def test_a_burst_of_1000_concurrent_requests_is_answered_exactly_once(server):
    answered_before = metric(server, "bls_requests_total", model="pipeline")
    outcomes = asyncio.run(drive(server.grpc_url, "pipeline", count=1000, concurrency=1000,
                                 data=image(42), prefix="burst"))
    errors = [str(error) for _, _, error in outcomes if error is not None]
    assert errors == [], f"{len(errors)} errors, e.g. {errors[:3]}"
    assert [sent for sent, _, _ in outcomes] == [answered for _, answered, _ in outcomes]
    assert len({answered for _, answered, _ in outcomes}) == 1000
    # The server side agrees: 1000 responses sent, none twice.
    assert metric(server, "bls_requests_total", model="pipeline") == answered_before + 1000


# -- metrics --------------------------------------------------------------------------------------
def test_bls_metrics_are_served_next_to_tritons(server, grpc_client):
    assert timed_infer(grpc_client, "grpc", "pipeline", image(14)).error is None
    for stage in ("preprocess", "classifier", "embedder"):
        assert metric(server, "bls_stage_latency_seconds_count", model="pipeline", stage=stage) > 0
    assert metric(server, "bls_request_latency_seconds_count", model="pipeline") > 0
    assert metric(server, "bls_requests_total", model="pipeline", code="SUCCESS") > 0
    assert metric(server, "bls_inflight_requests", model="pipeline") == 0
    assert metric(server, "bls_inflight_subrequests", model="pipeline") == 0
    assert metric(server, "nv_inference_count", model="pipeline") > 0
    errors = metric(server, "bls_subrequest_errors_total", model="pipeline_faulty",
                    stage="embedder", kind="failed")
    timed_infer(grpc_client, "grpc", "pipeline_faulty", image(15), request_id="fault_embedder:error:x")
    assert metric(server, "bls_subrequest_errors_total", model="pipeline_faulty",
                  stage="embedder", kind="failed") == errors + 1
