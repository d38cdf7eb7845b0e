"""How the BLS orchestrators behave under slow, failing and crashing sub-models, cancellation and
load — against the real server, with the test-only fault models (modelgen/fault_model.py,
modelgen/variants.py).

The only timing assertions are behaviour the orchestrator promises: an error on time after the
deadline (``support.assert_on_time``: the median within 50 ms, all but one within 250 ms and
every one within 500 ms on a busy 2-core host), and unrelated requests not waiting for a slow
one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bls_models import spec as S
from bls_models.metrics import FAMILIES, known_series
from bls_models.spec import registered
from tests.helpers import (
    SLACK,
    STATUS,
    assert_on_time,
    drive,
    eventually,
    image,
    inference_count,
    metric,
    metrics_text,
    request_inputs,
    settled,
    timed_infer,
)

REPEATS = 3  # requests per on-time check: their median is held to the promise (support.ON_TIME)


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
def test_a_slow_request_holds_up_only_its_own_instance(protocol, server):
    """A request stuck 1 s in a slow sub-model; 50 unrelated requests still finish promptly.

    An instance runs one batch at a time (every answer is given before ``execute`` returns), so
    the slow request holds its instance for that second; the other instances take the rest.
    One slow request fewer than the orchestrator has instances: serialised behind it, the 50
    would wait for it.
    """
    import tritonclient.http as httpclient

    instances = S.PIPELINE.instance_count  # pipeline_faulty is a variant of pipeline
    slow_count = instances - 1

    def make_client():
        if protocol == "http":
            return httpclient.InferenceServerClient(server.http_url, concurrency=64,
                                                    network_timeout=60)
        return grpcclient.InferenceServerClient(server.grpc_url)

    pool = concurrent.futures.ThreadPoolExecutor(50 + slow_count)
    clients = [make_client() for _ in range(50 + slow_count)]
    try:
        slow = []
        for i in range(slow_count):
            slow.append(pool.submit(timed_infer, clients[i], protocol, "pipeline_faulty", image(i),
                                    request_id=f"slow-{i};fault_classifier:delay:1000"))
            time.sleep(0.1)  # each slow request is inside the orchestrator before the next
        others = [pool.submit(timed_infer, clients[slow_count + i], protocol, "pipeline_faulty",
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
    # Serialised behind the slow request, every one would take 0.8 s or more; p90 leaves room
    # for the few a busy host delays.
    assert latencies[44] < 0.8, f"p90 of 50: {latencies[44]:.3f} s (p50 {latencies[25]:.3f} s, " \
                                f"slowest {latencies[-1]:.3f} s)"


def test_requests_asking_for_different_outputs_each_get_their_own(server, grpc_client):
    """Requests arriving together, some asking for two of the outputs and holding the
    classifier 400 ms, the rest for all three: requests of one ``execute`` share a group
    whatever they ask for (the run function learns which rows asked for what), and each gets
    exactly its own rows' outputs."""
    expected = {seed: timed_infer(grpc_client, "grpc", "pipeline_faulty", image(seed)).result
                for seed in range(8)}
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(8)]
    pool = concurrent.futures.ThreadPoolExecutor(8)
    try:
        futures = {seed: pool.submit(
            timed_infer, clients[seed], "grpc", "pipeline_faulty", image(seed),
            request_id=(f"slow-{seed};fault_classifier:delay:400" if seed % 4 == 0
                        else f"fast-{seed}"),
            outputs=[grpcclient.InferRequestedOutput(name) for name in ("CLASS_IDS", "EMBEDDING")]
            if seed % 4 == 0 else None) for seed in range(8)}
        outcomes = {seed: future.result(timeout=60) for seed, future in futures.items()}
    finally:
        pool.shutdown()
        for client in clients:
            client.close()
    for seed, outcome in outcomes.items():
        assert outcome.error is None, f"{seed}: {outcome.error}"
        for name in ("CLASS_IDS", "EMBEDDING"):
            np.testing.assert_allclose(outcome.result.as_numpy(name),
                                       expected[seed].as_numpy(name), rtol=1e-4, atol=1e-5)
        # Only what it asked for.
        assert (outcome.result.as_numpy("CLASS_PROBS") is None) == (seed % 4 == 0), seed
    assert all(outcomes[seed].elapsed >= 0.4 for seed in (0, 4))
    assert timed_infer(grpc_client, "grpc", "pipeline", image(9)).error is None


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
    outcomes = [timed_infer(client_for(protocol), protocol, model, data, name=name, dtype=dtype,
                            request_id=f"fault_{stage}:delay:{int(budget * 1000) + 500}",
                            timeout_us=int(budget * 1e6)) for _ in range(REPEATS)]
    for outcome in outcomes:
        assert_error(outcome, protocol, "UNAVAILABLE", "deadline", f"'{stage}'", f"fault_{stage}")
    assert_on_time([o.elapsed for o in outcomes], budget)


def test_default_deadline_applies_without_a_client_timeout(grpc_client):
    # pipeline_faulty: default_deadline_ms = 1500
    outcomes = [timed_infer(grpc_client, "grpc", "pipeline_faulty", image(5),
                            request_id="fault_classifier:delay:2000") for _ in range(REPEATS)]
    for outcome in outcomes:
        assert_error(outcome, "grpc", "UNAVAILABLE", "deadline", "'classifier'", "default deadline")
        assert outcome.elapsed >= 1.5
    assert_on_time([o.elapsed for o in outcomes], 1.5)


def test_stage_timeout_caps_one_stage(grpc_client):
    # pipeline_faulty: embedder_timeout_ms = 400; the client allows 5 s.
    outcomes = [timed_infer(grpc_client, "grpc", "pipeline_faulty", image(6),
                            request_id="fault_embedder:delay:1000", timeout_us=5_000_000)
                for _ in range(REPEATS)]
    for outcome in outcomes:
        assert_error(outcome, "grpc", "UNAVAILABLE", "deadline", "'embedder'", "stage timeout")
        assert outcome.elapsed >= 0.4
    assert_on_time([o.elapsed for o in outcomes], 0.4)


def test_a_deadline_both_branches_miss_is_counted_once_per_request(grpc_client, server):
    model = "pipeline_faulty"
    requests = settled(server, "bls_deadline_exceeded_total", model=model)
    sub_requests = settled(server, "bls_subrequest_errors_total", model=model, kind="deadline")
    outcome = timed_infer(grpc_client, "grpc", model, image(16), timeout_us=300_000,
                          request_id="fault_classifier:delay:800;fault_embedder:delay:800")
    assert_error(outcome, "grpc", "UNAVAILABLE", "deadline")
    # Each branch's sub-request failed on the deadline; the request missed it once.
    assert eventually(server, "bls_subrequest_errors_total", sub_requests + 2, model=model,
                      kind="deadline") == sub_requests + 2
    assert settled(server, "bls_deadline_exceeded_total", model=model) == requests + 1


def test_abandoned_sub_requests_are_counted_and_complete(grpc_client, server):
    labels = {"model": "pipeline_faulty", "stage": "classifier"}

    abandoned = settled(server, "bls_abandoned_subrequests_total", **labels)
    # Earlier tests' abandoned sub-requests have all finished.
    completed = eventually(server, "bls_abandoned_subrequests_completed_total", abandoned,
                           **labels)
    assert abandoned == completed, "abandoned sub-requests that never complete"
    outcome = timed_infer(grpc_client, "grpc", "pipeline_faulty", image(7),
                          request_id="fault_classifier:delay:600", timeout_us=200_000)
    assert_error(outcome, "grpc", "UNAVAILABLE", "deadline")
    assert eventually(server, "bls_abandoned_subrequests_total", abandoned + 1,
                      **labels) == abandoned + 1
    # The sub-model finishes the abandoned work (its result is dropped) and it is counted.
    assert eventually(server, "bls_abandoned_subrequests_completed_total", completed + 1,
                      **labels) == completed + 1
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
    """fault_queue has one instance and room for 2 queued requests; pipeline_queue takes one
    request per ``execute`` and has an instance for each request here, so the burst's 7
    requests send 7 sub-requests at once while the first request holds fault_queue for 1 s."""
    pool = concurrent.futures.ThreadPoolExecutor(8)
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(8)]
    try:
        busy = pool.submit(timed_infer, clients[0], "grpc", "pipeline_queue", image(1),
                           request_id="fault_queue:delay:1000")
        time.sleep(0.3)
        burst = [pool.submit(timed_infer, clients[i], "grpc", "pipeline_queue", image(i),
                             timeout_us=20_000_000 + 1000 * i) for i in range(1, 8)]
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
    assert outcome.elapsed < 3.0 + SLACK  # a crash is never waited out past the deadline
    # The orchestrator and the rest of the server carry on.
    again = timed_infer(grpc_client, "grpc", "pipeline_crash", image(11))
    assert again.error is not None and "'classifier'" in again.error.message()
    assert timed_infer(grpc_client, "grpc", "pipeline", image(12)).error is None


# -- cancellation ---------------------------------------------------------------------------------
def test_a_cancelled_request_stops_before_the_next_stage(server, grpc_client):
    before = inference_count(grpc_client, "fault_classifier")
    cancelled = settled(server, "bls_cancelled_requests_total", model="pipeline_faulty")
    answered = settled(server, "bls_requests_total", model="pipeline_faulty", code="CANCELLED")
    # The gRPC deadline (client_timeout) cancels the request while preprocess takes 0.8 s.
    outcome = timed_infer(grpc_client, "grpc", "pipeline_faulty", image(13),
                          request_id="fault_preprocess:delay:800", client_timeout=0.3)
    assert outcome.error is not None and "Deadline" in str(outcome.error)
    # preprocess finishes after 0.8 s; the orchestrator must then stop, before both branches.
    assert eventually(server, "bls_requests_total", answered + 1, model="pipeline_faulty",
                      code="CANCELLED") == answered + 1, "answered exactly once, as CANCELLED"
    # Counted once per request, though both branches (classifier, embedder) saw it cancelled.
    assert settled(server, "bls_cancelled_requests_total", model="pipeline_faulty") \
        == cancelled + 1
    assert inference_count(grpc_client, "fault_classifier") == before, "classifier was still called"


# -- load -----------------------------------------------------------------------------------------
def test_a_burst_of_1000_concurrent_requests_is_answered_exactly_once(server):
    answered_before = settled(server, "bls_requests_total", model="pipeline")
    outcomes = asyncio.run(drive(server.grpc_url, "pipeline", count=1000, concurrency=1000,
                                 data=image(42), prefix="burst"))
    errors = [str(error) for _, _, error in outcomes if error is not None]
    assert errors == [], f"{len(errors)} errors, e.g. {errors[:3]}"
    assert [sent for sent, _, _ in outcomes] == [answered for _, answered, _ in outcomes]
    assert len({answered for _, answered, _ in outcomes}) == 1000
    # The server side agrees: 1000 responses sent, none twice.
    assert eventually(server, "bls_requests_total", answered_before + 1000,
                      model="pipeline") == answered_before + 1000


# -- metrics --------------------------------------------------------------------------------------
def test_bls_metrics_are_served_next_to_tritons(server, grpc_client):
    assert timed_infer(grpc_client, "grpc", "pipeline", image(14)).error is None
    def positive(value):
        return value > 0
    for stage in ("preprocess", "classifier", "embedder"):
        assert eventually(server, "bls_stage_latency_seconds_count", positive, model="pipeline",
                          stage=stage) > 0
    assert eventually(server, "bls_request_latency_seconds_count", positive, model="pipeline") > 0
    assert eventually(server, "bls_requests_total", positive, model="pipeline", code="SUCCESS") > 0
    assert settled(server, "bls_inflight_requests", model="pipeline") == 0
    assert settled(server, "bls_inflight_subrequests", model="pipeline") == 0
    assert metric(server, "nv_inference_count", model="pipeline") > 0
    labels = {"model": "pipeline_faulty", "stage": "embedder", "kind": "failed"}
    errors = settled(server, "bls_subrequest_errors_total", **labels)
    timed_infer(grpc_client, "grpc", "pipeline_faulty", image(15), request_id="fault_embedder:error:x")
    assert eventually(server, "bls_subrequest_errors_total", errors + 1, **labels) == errors + 1


def test_every_known_series_is_exported_from_load(server):
    """Prometheus conventions: each known label set exists at 0 before its first event, so
    ``rate()`` and dashboards see the error and deadline families from the start."""
    samples = set()
    for line in metrics_text(server).splitlines():
        match = re.match(r"^(\w+)\{(.*)\} \S+$", line)
        if match:
            samples.add((match.group(1), frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2)))))
    for model in S.BLS_MODELS:
        for family, labels in known_series(registered(model.orchestrates).contracts):
            name = f"{family}_count" if FAMILIES[family][0] == "HISTOGRAM" else family
            wanted = frozenset({"model": model.name, **labels}.items())
            assert any(n == name and wanted <= found for n, found in samples), (name, wanted)
