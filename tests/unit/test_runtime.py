"""The orchestrator runtime (``bls_models.triton_runtime.Orchestrator``) with its committed
parameters, a fake ``pb_utils`` and in-process sub-models: the normal path, deadlines,
cancellation, admission, shutdown and exactly-once answers, with no server."""

from __future__ import annotations

import threading
import time

import numpy as np

from bls_models import spec as S
from tests.helpers import (
    SLACK,
    counted,
    executing,
    image_inputs,
    orchestrator,
    settled_metric,
    shorten_shutdown,
    sub_models,
    wait_answered,
)
from tests.unit.fake_pb_utils import FakePbUtils, Request


def test_each_request_is_answered_once_with_its_outputs_returned_from_execute(made, long_hold):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_inputs(1 + i % 3), request_id=f"r{i}") for i in range(30)]
    for start in range(0, 30, 7):  # several execute calls, as Triton batches them
        returned = pb.execute(orch, requests[start:start + 7])
        assert returned is not None and all(r is not None for r in returned)
    time.sleep(0.1)  # a second answer would arrive by now
    for request in requests:
        response = request.answer
        assert not response.has_error() and request.sender.attempts == 0
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


def test_the_normal_path_makes_no_round_trip_of_its_own(made, long_hold):
    """Answered within the hold: no response sender, no ``is_cancelled``, no ``send``; the
    sub-requests and one message back are all (metrics go out every 0.2 s, not per request)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_inputs(), request_id=f"r{i}") for i in range(4)]
    pb.execute(orch, requests)
    for name in ("get_response_sender", "is_cancelled", "send"):
        assert pb.faults.calls[name] == 0, name
    assert pb.faults.calls["exec"] == 3


def test_a_deadline_both_branches_miss_is_answered_on_time_and_counted_once(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    request = Request(image_inputs(), request_id="classifier=0.6;embedder=0.6", timeout_us=200_000)
    started = time.monotonic()
    pb.execute(orch, [request])
    wait_answered([request])
    elapsed = time.monotonic() - started
    response = request.answer
    assert response.has_error() and "deadline exceeded" in response.error().message()
    assert response.error().code() == pb.TritonError.UNAVAILABLE
    assert 0.2 <= elapsed < 0.2 + SLACK  # on time, with room for a busy host
    assert settled_metric(pb, "bls_deadline_exceeded_total") == 1
    # One per branch out at the deadline (both, unless a busy host had not sent them yet).
    abandoned = pb.metric("bls_abandoned_subrequests_total")
    assert pb.metric("bls_subrequest_errors_total", kind="deadline") == abandoned <= 2
    assert abandoned == len([s for s in pb.sent if s.model != "preprocess"])
    # The abandoned sub-requests finish on their own (their results dropped) and are counted.
    time.sleep(0.6)
    assert settled_metric(pb, "bls_abandoned_subrequests_completed_total") == abandoned
    assert len(request.answers) == 1


def test_a_batch_slower_than_the_hold_is_answered_through_its_senders(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, return_within_ms="50"))
    slow = Request(image_inputs(), request_id="slow;classifier=0.3")
    started = time.monotonic()
    assert pb.execute(orch, [slow]) is None
    assert time.monotonic() - started < 0.05 + SLACK, "execute held its instance"
    wait_answered([slow])
    assert slow.returned is None and len(slow.sender.sent) == 1
    assert not slow.answer.has_error()
    assert settled_metric(pb, "bls_detached_requests_total") == 1


def test_a_cancelled_request_stops_before_its_next_stages_and_is_counted_once(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, return_within_ms="50"))
    request = Request(image_inputs(), request_id="preprocess=0.3")
    pb.execute(orch, [request])
    time.sleep(0.1)
    request.sender.cancelled.set()  # the client goes away while preprocess runs
    wait_answered([request])
    assert request.answer.error().code() == pb.TritonError.CANCELLED
    assert [model for model, _ in pb.calls] == ["preprocess"], "a branch was still called"
    assert settled_metric(pb, "bls_cancelled_requests_total") == 1  # not once per branch
    assert pb.metric("bls_requests_total", code="CANCELLED") == 1
    assert request.sender.asked == 1, "asked once before the branches, not once per branch"


def test_a_request_that_waited_for_a_slot_is_checked_before_its_first_stage(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1"))
    first = Request(image_inputs(), request_id="classifier=0.3")
    late = Request(image_inputs())
    late.sender.cancelled.set()  # cancelled while it waited behind the first for a slot
    pb.execute(orch, [first, late])
    wait_answered([first, late])
    assert late.answer.error().code() == pb.TritonError.CANCELLED
    assert [rid for _, rid in pb.calls].count("") == 0, "the cancelled request reached a stage"
    assert settled_metric(pb, "bls_cancelled_requests_total", stage="preprocess") == 1


def test_execute_does_not_hold_its_instance_for_requests_waiting_for_a_slot(made):
    """Every slot taken by slow requests: a new batch can get no answer before a slot frees,
    so execute returns at once and the batch waits in the orchestrator's queue, each request
    answered at its deadline."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="2", return_within_ms="50"))
    blockers = [Request(image_inputs(), request_id=f"b{i};classifier=1.0") for i in range(2)]
    pb.execute(orch, blockers)
    waiting = [Request(image_inputs(), request_id=f"w{i}", timeout_us=300_000) for i in range(6)]
    started = time.monotonic()
    assert pb.execute(orch, waiting) is None
    assert time.monotonic() - started < 0.05, "execute waited for answers that could not come"
    wait_answered(waiting)
    for request in waiting:
        assert request.answer.error().code() == pb.TritonError.UNAVAILABLE
        assert request.sender.answered_at - started < 0.3 + SLACK
    wait_answered(blockers)


def test_a_failing_sub_model_fails_its_request_with_internal_naming_the_stage(made):
    pb = FakePbUtils(sub_models(fail={"embedder"}))
    made.append(orch := orchestrator(pb))
    request = Request(image_inputs())
    pb.execute(orch, [request])
    wait_answered([request])
    assert request.answer.error().code() == pb.TritonError.INTERNAL
    assert "stage 'embedder'" in request.answer.error().message()
    assert settled_metric(pb, "bls_subrequest_errors_total", stage="embedder", kind="failed") == 1


def test_a_stage_timeout_caps_its_sub_request(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, classifier_timeout_ms="100"))
    request = Request(image_inputs(), request_id="classifier=0.5", timeout_us=3_000_000)
    started = time.monotonic()
    pb.execute(orch, [request])
    wait_answered([request])
    error = request.answer.error()
    assert error.code() == pb.TritonError.UNAVAILABLE and "stage timeout" in error.message()
    assert request.sender.answered_at - started < 0.1 + SLACK
    assert settled_metric(pb, "bls_abandoned_subrequests_total", stage="classifier") == 1


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


def test_backpressure_bounds_requests_in_flight(made):
    """Without a queue in the orchestrator (max_queued_requests 0), execute waits for a slot:
    further requests stay in Triton's queue."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="2", max_queued_requests="0"))
    requests = [Request(image_inputs(), request_id=f"r{i};classifier=0.2") for i in range(4)]
    started = time.monotonic()
    threading.Thread(target=pb.execute, args=(orch, requests[:2]), daemon=True).start()
    time.sleep(0.02)
    pb.execute(orch, requests[2:])  # waits for a slot: returns only once two were answered
    assert time.monotonic() - started >= 0.2
    wait_answered(requests)
    assert all(len(r.answers) == 1 for r in requests)


def test_requests_beyond_the_slots_wait_in_the_orchestrator_first_come_first_served(made):
    """With a queue in the orchestrator, execute returns at once for those waiting; at most
    max_inflight_requests run at once, the others start in arrival order as slots free."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="2", max_queued_requests="4",
                                     return_within_ms="50"))
    requests = [Request(image_inputs(), request_id=f"q{i};classifier=0.2", timeout_us=5_000_000)
                for i in range(6)]
    for index in range(0, 6, 2):
        pb.execute(orch, requests[index:index + 2])
    wait_answered(requests)
    assert all(not r.answer.has_error() for r in requests)
    started = {member.split(";")[0]: s.started for s in pb.sent if s.model == "classifier"
               for member in s.request_id.split(",")}
    pairs = [max(started[f"q{i}"], started[f"q{i + 1}"]) for i in (0, 2, 4)]
    firsts = [min(started[f"q{i}"], started[f"q{i + 1}"]) for i in (0, 2, 4)]
    # Two at once, in arrival order: each pair started once the one before had its 0.2 s.
    assert all(later - earlier >= 0.19 for earlier, later in zip(pairs, firsts[1:])), started


def test_a_slot_is_held_until_the_sub_requests_of_its_group_are_back(made):
    """A request answered at its deadline while its classifier sub-request is still out keeps
    its slot until that sub-request is back: the next queued request starts no stage before
    then (the slots bound the work in flight, not only the requests waiting for answers)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1", max_queued_requests="4",
                                     return_within_ms="50"))
    blocker = Request(image_inputs(), request_id="blocker;classifier=0.6", timeout_us=200_000)
    queued = Request(image_inputs(), request_id="queued", timeout_us=5_000_000)
    sent = time.monotonic()
    pb.execute(orch, [blocker, queued])
    wait_answered([blocker, queued])
    assert blocker.answer.error().code() == pb.TritonError.UNAVAILABLE
    assert blocker.sender.answered_at - sent < 0.2 + SLACK
    assert not queued.answer.has_error()
    classifier = next(s for s in pb.sent if s.model == "classifier" and "blocker" in s.request_id)
    first = next(s for s in pb.sent if s.model == "preprocess" and "queued" in s.request_id)
    assert first.started >= classifier.started + 0.6, "the queued request started while the " \
        "answered one's sub-request was still out"


def test_a_request_that_cannot_be_read_fails_alone(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    unreadable = Request({"PIXELS": np.zeros((1, 3), np.float32)})  # no IMAGE
    good = Request(image_inputs())
    pb.execute(orch, [unreadable, good])
    assert unreadable.answer.error().code() == pb.TritonError.INVALID_ARG
    assert not good.answer.has_error()


def test_a_sub_request_whose_deadline_passed_before_a_thread_took_it_is_never_sent(made):
    """One worker thread: the second batch's group waits behind the first's and its 0.2 s
    deadline passes there; it is answered on time and never reaches the sub-model."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, subrequest_threads="1", return_within_ms="20"))
    first = Request(image_inputs(), request_id="first;preprocess=0.5")
    second = Request(image_inputs(), request_id="second", timeout_us=200_000)
    pb.execute(orch, [first])
    sent = time.monotonic()
    pb.execute(orch, [second])
    wait_answered([first, second])
    assert second.answer.error().code() == pb.TritonError.UNAVAILABLE
    assert second.sender.answered_at - sent < 0.2 + SLACK
    assert not first.answer.has_error()
    assert [rid for _, rid in pb.calls].count("second") == 0


def test_shutdown_lets_sub_requests_out_finish_and_answers_their_requests(made):
    pb = FakePbUtils(sub_models())
    orch, request = executing(pb, "classifier=0.3")  # detached: its classifier is out
    pb.finalize(orch)
    assert not request.answer.has_error(), request.answer.error().message()
    assert pb.violations == []


def test_shutdown_answers_a_request_that_needs_another_stage_unavailable(made):
    """From finalize on, r24.10 refuses sub-requests: a request whose next stage had not been
    sent is answered UNAVAILABLE at once, not after a futile drain."""
    pb = FakePbUtils(sub_models())
    orch, request = executing(pb, "preprocess=0.3")
    started = time.monotonic()
    pb.finalize(orch)
    assert time.monotonic() - started < 1.0
    error = request.answer.error()
    assert error.code() == pb.TritonError.UNAVAILABLE and "shutting down" in error.message()
    assert [model for model, _ in pb.calls] == ["preprocess"]
    assert pb.violations == []


def test_shutdown_answers_what_outlives_the_drain_once_with_unavailable(monkeypatch):
    shorten_shutdown(monkeypatch, 0.2)
    pb = FakePbUtils(sub_models())
    orch, slow = executing(pb, "classifier=1.0")
    started = time.monotonic()
    pb.finalize(orch)
    assert time.monotonic() - started < 1.0, "close waited for the sub-model"
    error = slow.answer.error()
    assert error.code() == pb.TritonError.UNAVAILABLE and "shutting down" in error.message()
    assert pb.metric("bls_requests_total", code="UNAVAILABLE") == 1
    time.sleep(1.0)  # the sub-model answers the thread left behind: it must not use pb_utils
    assert pb.violations == []
    assert counted(pb, orch, "bls_requests_total") == 1
