"""The orchestrator runtime (``bls_models.triton_runtime.Orchestrator``) with a fake ``pb_utils``
and in-process sub-models: its event-loop thread, sub-request pool, deadlines, cancellation,
counters and exactly-once answers, with no server (each test takes well under a second)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np

from bls_models import spec as S
from bls_models.metrics import FLUSH_SECONDS
from bls_models.triton_runtime import Orchestrator
from modelgen import configs
from tests.unit.fake_pb_utils import FakePbUtils, Request, SubModelError

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"


def delay_for(request, model: str) -> float:
    """Seconds a fake sub-model sleeps: the request id may carry ``<model>=<seconds>`` (a
    group's or a coalesced sub-request's ids are joined by commas: the longest applies)."""
    delay = 0.0
    for member in request.request_id.split(","):
        for part in member.split(";"):
            name, _, seconds = part.partition("=")
            if name == model:
                delay = max(delay, float(seconds))
    return delay


def sub_models(fail: set[str] = frozenset()) -> dict:
    def model(name, outputs):
        def run(inputs, request):
            time.sleep(delay_for(request, name))
            if name in fail:
                raise SubModelError(f"{name} failed on purpose")
            batch = next(iter(inputs.values())).shape[0]
            rng = np.random.default_rng(batch)
            return {t.name: rng.standard_normal((batch, *t.dims)).astype(np.float32)
                    for t in outputs}
        return run

    return {m.name: model(m.name, m.outputs) for m in (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER)}


def orchestrator(pb: FakePbUtils, **parameters: str) -> Orchestrator:
    """The committed pipeline's config with ``parameters`` over it; coalescing off unless asked
    for (test_runtime_coalescing.py): these tests count sub-requests per request."""
    spec = S.PIPELINE
    config = configs.config_dict(spec)
    config["parameters"].update({k: {"string_value": v}
                                 for k, v in {"coalesce": "off", **parameters}.items()})
    return Orchestrator(pb, {"model_name": spec.name, "model_config": json.dumps(config),
                             "model_repository": str(REPOSITORY / spec.name)}, "pipeline")


def image(batch: int = 1) -> dict[str, np.ndarray]:
    return {"IMAGE": np.zeros((batch, *S.IMAGE.dims), np.uint8)}


def wait_answered(requests: list[Request], timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    for request in requests:
        assert request.sender.done.wait(max(0.0, give_up - time.monotonic())), "never answered"


def settled_metric(pb: FakePbUtils, family: str, **labels: str) -> float:
    time.sleep(2 * FLUSH_SECONDS)  # counters are published by the runtime's flush
    return pb.metric(family, **labels)


def test_each_request_is_answered_once_with_its_outputs(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image(1 + i % 3), request_id=f"r{i}") for i in range(30)]
    for start in range(0, 30, 7):  # several execute calls, as Triton batches them
        pb.execute(orch, requests[start:start + 7])
    wait_answered(requests)
    time.sleep(0.1)  # a second answer would arrive by now
    for request in requests:
        (response,) = request.answers
        assert not response.has_error()
        outputs = {t.name(): t.as_numpy() for t in response.output_tensors}
        batch = request.input("IMAGE").shape[0]
        assert outputs["CLASS_IDS"].shape == (batch, S.TOP_K)
        assert outputs["EMBEDDING"].shape == (batch, S.EMBEDDING_DIM)
    assert settled_metric(pb, "bls_requests_total", code="SUCCESS") == 30
    assert pb.metric("bls_inflight_requests") == 0
    # Every sub-request carried the ids of the client requests whose rows it held.
    assert {i for _, rids in pb.calls for i in rids.split(",")} == {f"r{i}" for i in range(30)}
    # The requests of one execute call ran as one group: one sub-request per stage per call.
    assert len(pb.calls) == 3 * 5


def test_a_deadline_both_branches_miss_is_answered_on_time_and_counted_once(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    request = Request(image(), request_id="classifier=0.6;embedder=0.6", timeout_us=200_000)
    started = time.monotonic()
    pb.execute(orch, [request])
    wait_answered([request])
    elapsed = time.monotonic() - started
    (response,) = request.answers
    assert response.has_error() and "deadline exceeded" in response.error().message()
    assert response.error().code() == pb.TritonError.UNAVAILABLE
    assert 0.2 <= elapsed < 0.2 + 0.25  # on time, with room for a busy host
    assert settled_metric(pb, "bls_deadline_exceeded_total") == 1
    assert pb.metric("bls_subrequest_errors_total", kind="deadline") == 2  # one per branch
    assert pb.metric("bls_abandoned_subrequests_total") == 2
    # The abandoned sub-requests finish on their own (their results dropped) and are counted.
    time.sleep(0.6)
    assert settled_metric(pb, "bls_abandoned_subrequests_completed_total") == 2
    assert len(request.answers) == 1


def test_a_cancelled_request_stops_before_its_next_stages_and_is_counted_once(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    request = Request(image(), request_id="preprocess=0.3")
    pb.execute(orch, [request])
    time.sleep(0.1)
    request.sender.cancelled.set()  # the client goes away while preprocess runs
    wait_answered([request])
    (response,) = request.answers
    assert response.error().code() == pb.TritonError.CANCELLED
    assert [model for model, _ in pb.calls] == ["preprocess"], "a branch was still called"
    assert settled_metric(pb, "bls_cancelled_requests_total") == 1  # not once per branch
    assert pb.metric("bls_requests_total", code="CANCELLED") == 1


def test_cancellation_is_asked_once_per_step_not_per_stage(made):
    """Each is_cancelled() is an IPC round trip: the concurrent branches share one answer, and
    the first stage relies on Triton's scheduler, which checked as it handed over the request."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image(), request_id=f"r{i}") for i in range(5)]
    for request in requests:
        pb.execute(orch, [request])
        wait_answered([request])
    for request in requests:
        (response,) = request.answers
        assert not response.has_error(), response.error().message()
        assert request.sender.asked == 1, "asked before preprocess, or once per branch"


def test_a_request_that_waited_for_a_slot_is_checked_before_its_first_stage(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1"))
    first = Request(image(), request_id="classifier=0.3")
    late = Request(image())
    late.sender.cancelled.set()  # cancelled while it waited behind the first for a slot
    pb.execute(orch, [first])
    pb.execute(orch, [late])  # waits for the slot
    wait_answered([first, late])
    (response,) = late.answers
    assert response.error().code() == pb.TritonError.CANCELLED
    assert [rid for _, rid in pb.calls].count("") == 0, "the cancelled request reached a stage"
    assert settled_metric(pb, "bls_cancelled_requests_total", stage="preprocess") == 1


def test_a_failing_sub_model_fails_its_request_with_internal_naming_the_stage(made):
    pb = FakePbUtils(sub_models(fail={"embedder"}))
    made.append(orch := orchestrator(pb))
    request = Request(image())
    pb.execute(orch, [request])
    wait_answered([request])
    (response,) = request.answers
    assert response.error().code() == pb.TritonError.INTERNAL
    assert "stage 'embedder'" in response.error().message()
    assert settled_metric(pb, "bls_subrequest_errors_total", stage="embedder", kind="failed") == 1


def test_every_known_series_exists_at_zero_before_any_request(made):
    pb = FakePbUtils(sub_models())
    made.append(orchestrator(pb))
    for stage in ("preprocess", "classifier", "embedder"):
        for kind in ("deadline", "queue_full", "not_ready", "shm", "invalid", "cancelled", "failed"):
            key = ("bls_subrequest_errors_total", ("kind", kind), ("model", "pipeline"),
                   ("stage", stage))
            assert pb.metrics.get(key) == 0, key
        assert pb.metrics.get(("bls_deadline_exceeded_total", ("model", "pipeline"),
                               ("stage", stage))) == 0
    for code in ("SUCCESS", "INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"):
        assert pb.metrics.get(("bls_requests_total", ("code", code), ("model", "pipeline"))) == 0


def test_shutdown_drains_what_is_in_flight_and_answers_every_request_once():
    pb = FakePbUtils(sub_models())
    orch = orchestrator(pb)
    quick = [Request(image(), request_id=f"q{i}") for i in range(5)]
    pb.execute(orch, quick)
    orch.close()  # waits for what is in flight (bounded), then stops
    assert all(len(r.answers) == 1 for r in quick)
    assert all(not r.answers[0].has_error() for r in quick)


def test_backpressure_bounds_requests_in_flight(made):
    """Without a queue in the orchestrator (max_queued_requests 0), execute waits for a slot:
    further requests stay in Triton's queue."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="2", max_queued_requests="0"))
    requests = [Request(image(), request_id="classifier=0.2") for _ in range(4)]
    started = time.monotonic()
    pb.execute(orch, requests[:2])
    pb.execute(orch, requests[2:])  # waits for a slot: execute returns only once two were answered
    assert time.monotonic() - started >= 0.2
    wait_answered(requests)
    assert all(len(r.answers) == 1 for r in requests)


def test_requests_beyond_the_slots_wait_in_the_orchestrator_first_come_first_served(made):
    """With a queue in the orchestrator, execute returns at once; at most max_inflight_requests
    run at once, the others start in arrival order as slots free, and beyond
    max_inflight_requests + max_queued_requests execute waits."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="2", max_queued_requests="2"))
    requests = [Request(image(), request_id=f"q{i};classifier=0.2") for i in range(6)]
    started = time.monotonic()
    pb.execute(orch, requests[:4])
    assert time.monotonic() - started < 0.1, "execute waited although the queue had room"
    pb.execute(orch, requests[4:])  # no room: waits until two are answered
    assert time.monotonic() - started >= 0.2
    wait_answered(requests)
    assert all(not answer.has_error() for r in requests for answer in r.answers)
    order = [member.split(";")[0] for model, rids in pb.calls if model == "classifier"
             for member in rids.split(",")]
    assert order == [f"q{i}" for i in range(6)], order
    # Never more than two at once: the third started only when the first had taken its 0.2 s.
    starts = sorted(s.started for s in pb.sent if s.model == "classifier")
    assert all(later - first >= 0.19 for first, later in zip(starts, starts[2:])), starts


def test_shutdown_answers_what_outlives_the_drain_once_with_unavailable(monkeypatch):
    from bls_models import triton_runtime

    monkeypatch.setattr(triton_runtime, "SHUTDOWN_DRAIN_SECONDS", 0.2)
    monkeypatch.setattr(triton_runtime, "SHUTDOWN_THREADS_SECONDS", 0.2)
    pb = FakePbUtils(sub_models())
    orch = orchestrator(pb)
    slow = Request(image(), request_id="classifier=1.0")
    pb.execute(orch, [slow])
    started = time.monotonic()
    pb.finalize(orch)
    assert time.monotonic() - started < 1.0, "close waited for the sub-model"
    (response,) = slow.answers
    assert response.error().code() == pb.TritonError.UNAVAILABLE
    assert "shutting down" in response.error().message()
    assert pb.metric("bls_requests_total", code="UNAVAILABLE") == 1
    time.sleep(1.0)  # the sub-model answers the thread left behind: it must not use pb_utils
    assert pb.violations == []
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-")]


def test_a_request_that_cannot_be_read_fails_alone_and_frees_its_slot(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1"))
    unreadable = Request({"PIXELS": np.zeros((1, 3), np.float32)})  # no IMAGE
    good = Request(image())
    pb.execute(orch, [unreadable, good])  # would wait forever if the refused request kept its slot
    wait_answered([unreadable, good])
    (refused,) = unreadable.answers
    assert refused.error().code() == pb.TritonError.INVALID_ARG
    assert len(good.answers) == 1 and not good.answers[0].has_error()


def test_a_sub_request_whose_deadline_passed_before_a_thread_took_it_is_never_sent(made):
    """One sub-request thread: the second request's preprocess waits behind the first's and its
    0.2 s deadline passes there; it is answered on time and never reaches the sub-model."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, subrequest_threads="1"))
    first = Request(image(), request_id="first;preprocess=0.5")
    second = Request(image(), request_id="second", timeout_us=200_000)
    pb.execute(orch, [first, second])
    wait_answered([first, second])
    assert second.answers[0].error().code() == pb.TritonError.UNAVAILABLE
    assert not first.answers[0].has_error()
    assert [rid for _, rid in pb.calls].count("second") == 0
    assert len(first.answers) == len(second.answers) == 1


def test_the_responder_answers_a_job_once_whoever_answers_it(made):
    """The pipeline and shutdown's cancellation can race to answer: the second send is a no-op
    and counts nothing."""
    import threading

    from bls_models.deadline import Deadline
    from bls_models.errors import Code, PipelineError
    from bls_models.metrics import Metrics
    from bls_models.responder import Job, Responder

    pb = FakePbUtils({})
    metrics = Metrics(pb, "pipeline")
    responder = Responder(pb, threading.RLock(), metrics, {"EMBEDDING": np.dtype(np.float32)},
                          max_inflight=1, model="pipeline", log=lambda *a, **k: None)
    request = Request(image())
    request.fake = request.sender.fake = pb
    job = Job(Deadline.for_request(0, 1000), time.monotonic(), rows=1, outputs=["EMBEDDING"],
              request_id="r", sender=request.get_response_sender())
    admitted = []
    responder.admit([job], admitted.extend)
    assert admitted == [job]
    responder.answer(job, {"EMBEDDING": np.ones((1, 256))}, None)
    responder.answer(job, None, PipelineError(Code.UNAVAILABLE, "shutting down"))
    metrics.flush()
    assert len(request.answers) == 1 and not request.answers[0].has_error()
    assert request.answer_attempts == 1 and pb.violations == []
    assert responder.pending == set()
    assert pb.metric("bls_requests_total", code="SUCCESS") == 1
    assert pb.metric("bls_requests_total", code="UNAVAILABLE") == 0
    assert responder.room.acquire(timeout=1), "the slot was never released"
