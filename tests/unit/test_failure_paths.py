"""The runtime's failure paths over the r24.10-like fake ``pb_utils`` (tests/unit/fake_pb_utils.py),
each named after what it holds to. The rule: every request that reaches ``execute`` gets exactly
one final response, whatever raises, within its deadline plus ``SLACK``, and nothing grows with
traffic."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque

import numpy as np
import pytest

from bls_models import spec as S
from bls_models.metrics import FLUSH_SECONDS, HISTOGRAM_FLUSH_SECONDS, Metrics
from tests.helpers import (
    SLACK,
    executing,
    image_inputs,
    orchestrator,
    settled_metric,
    shorten_shutdown,
    sub_models,
    wait_answered,
)
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import DirectedRowModels, exact, image_of


def execute_in_thread(pb, orch, requests) -> threading.Thread:
    """``execute`` from another thread (the stub's main thread may be held by backpressure)."""
    thread = threading.Thread(target=pb.execute, args=(orch, requests), daemon=True)
    thread.start()
    return thread


async def image_run(inputs, call, setup, reduce=None):
    """The pipeline's stages one after the other, with ``reduce`` on the classifier's output."""
    pixels = (await call("preprocess", {"IMAGE": inputs["IMAGE"]}, ["PIXELS"]))["PIXELS"]
    logits = await call("classifier", {"PIXELS": pixels}, ["LOGITS"], reduce=reduce)
    embedding = (await call("embedder", {"PIXELS": pixels}, ["EMBEDDING"]))["EMBEDDING"]
    rows = len(inputs["IMAGE"])
    return {"CLASS_IDS": np.zeros((rows, S.TOP_K), np.int64),
            "CLASS_PROBS": np.zeros((rows, S.TOP_K), np.float32),
            "EMBEDDING": embedding, **logits}


@pytest.mark.parametrize("logger_fails", [False, True])
def test_a_response_that_cannot_be_built_is_answered_internal_and_frees_its_slot(
        made, logger_fails):
    """The run function leaves a declared output out for one kind of input (a data-dependent
    bug): that request is answered INTERNAL at once, with no exception text; the log has the
    details. Even with the logger failing, the slot comes back (one slot: the next request
    runs)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1", max_queued_requests="0"))
    pipeline = orch.run

    async def leaves_embedding_out(inputs, call, setup):
        outputs = await pipeline(inputs, call, setup)
        if (inputs["IMAGE"] == 7).all():
            del outputs["EMBEDDING"]
        return outputs

    orch.run = leaves_embedding_out
    if logger_fails:
        pb.faults.plan("Logger", "always")
    bad, good = Request(image_of(7), request_id="bad"), Request(image_of(8), request_id="good")
    started = time.monotonic()
    pb.execute(orch, [bad])
    pb.execute(orch, [good])
    wait_answered([bad, good], timeout=5)
    assert time.monotonic() - started < 1.0
    error = bad.answer.error()
    assert error.code() == pb.TritonError.INTERNAL
    assert "KeyError" not in error.message() and "EMBEDDING" not in error.message()
    assert not good.answer.has_error()
    assert settled_metric(pb, "bls_requests_total", code="INTERNAL") == 1
    if not logger_fails:
        assert any("no output 'EMBEDDING'" in line for line in pb.log)


@pytest.mark.parametrize("queued", ["0", "512"])
def test_a_request_waiting_for_a_slot_is_answered_when_its_deadline_passes(made, queued):
    """One slot, held 1 s by the first request. The second (200 ms deadline) waits for it —
    in execute (no queue in the orchestrator) or in the orchestrator's queue — and is answered
    at its deadline (UNAVAILABLE, saying why), not once the slot frees."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1", max_queued_requests=queued,
                                     return_within_ms="20"))
    blocker = Request(image_inputs(), request_id="classifier=1.0")
    late = Request(image_inputs(), request_id="late", timeout_us=200_000)
    pb.execute(orch, [blocker])
    sent = time.monotonic()
    execute_in_thread(pb, orch, [late])
    wait_answered([late], timeout=5)
    assert late.sender.answered_at - sent < 0.2 + SLACK
    error = late.answer.error()
    assert error.code() == pb.TritonError.UNAVAILABLE
    assert "waiting for one of its 1 slots" in error.message()
    wait_answered([blocker])
    assert not blocker.answer.has_error()
    assert settled_metric(pb, "bls_deadline_exceeded_total", stage="admission") == 1


@pytest.mark.parametrize("queued", ["0", "512"])
def test_the_deadline_and_the_latency_count_the_wait_for_a_slot(made, queued):
    """Requests of one batch that wait behind each other for the one slot: their deadline and
    their recorded latency start when execute got them, not when they got a slot."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1", max_queued_requests=queued))
    slow = Request(image_inputs(), request_id="classifier=0.5")
    follower = Request(image_inputs(), request_id="follower", timeout_us=700_000)
    sent = time.monotonic()
    execute_in_thread(pb, orch, [slow, follower])
    wait_answered([slow, follower])
    # It got the slot at ~0.5 s with 0.2 s left: fine, it runs in a few ms.
    assert not follower.answer.has_error()
    assert follower.sender.answered_at - sent < 0.7
    time.sleep(HISTOGRAM_FLUSH_SECONDS + 2 * FLUSH_SECONDS)
    total = pb.metric("bls_request_latency_seconds_sum")
    assert pb.metric("bls_request_latency_seconds_count") == 2
    assert total >= 0.5 + 0.5 - 0.05, "the wait for the slot was not counted"


def test_a_request_whose_sender_cannot_be_had_is_answered_through_executes_list(made):
    """``get_response_sender`` raises as execute stops waiting for a slow request: it is
    answered INTERNAL through execute's return value at once, the others as usual."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, return_within_ms="20"))
    requests = [Request(image_inputs(), request_id=f"r{i};classifier=0.2", outputs=[["EMBEDDING"],
                                                                             ["CLASS_IDS"]][i % 2])
                for i in range(3)]
    pb.faults.plan("get_response_sender", "once", after=1)
    pb.execute(orch, requests)
    wait_answered(requests)
    time.sleep(0.1)
    assert pb.violations == []
    assert requests[1].answer.error().code() == pb.TritonError.INTERNAL
    assert requests[1].returned is not None and requests[1].sender.attempts == 0
    for request in (requests[0], requests[2]):
        assert not request.answer.has_error()


def test_a_send_that_raises_is_counted_and_execute_goes_on(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, return_within_ms="0"))
    requests = [Request(image_inputs(), request_id=f"r{i}") for i in range(3)]
    pb.faults.plan("send", "once")
    pb.execute(orch, requests)
    wait_answered(requests)
    lost = [r for r in requests if not r.answers]
    assert len(lost) == 1 and lost[0].sender.attempts == 1
    assert settled_metric(pb, "bls_requests_total", code="SEND_FAILED") == 1
    assert all(not r.answer.has_error() for r in requests if r not in lost)


def test_an_exception_building_a_groups_sub_request_answers_its_members_at_once(made):
    """Building a group's sub-request raises: every member is answered INTERNAL naming the stage
    at once, not after its deadline, and never re-run (the orchestrator's own failure)."""
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb, default_deadline_ms="3000"))
    group = [Request(image_of(v), request_id=f"g{v}") for v in (2, 3, 4)]
    pb.faults.plan("InferenceRequest", "once", after=1)
    started = time.monotonic()
    pb.execute(orch, group)
    wait_answered(group, timeout=5)
    assert max(r.sender.answered_at for r in group) - started < 1.0
    for request in group:
        assert request.answer.error().code() == pb.TritonError.INTERNAL
        assert "in stage '" in request.answer.error().message()
    assert pb.faults.raised["InferenceRequest"] == 1
    assert len(pb.calls) <= 3


def test_a_sub_requests_timeout_is_the_budget_left_when_it_is_sent(made):
    """One worker thread, held 0.5 s by the first request: the second's group waits for it,
    and its preprocess's Triton timeout is what is left of its 2 s then, not 2 s."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, subrequest_threads="1", return_within_ms="20"))
    first = Request(image_inputs(), request_id="first;preprocess=0.5")
    second = Request(image_inputs(), request_id="second", timeout_us=2_000_000)
    arrived = time.monotonic()
    pb.execute(orch, [first])
    pb.execute(orch, [second])
    wait_answered([first, second])
    (sent,) = [s for s in pb.sent if s.model == "preprocess" and s.request_id == "second"]
    left = arrived + 2.0 - sent.started
    assert sent.started - arrived > 0.4
    assert sent.timeout_us / 1e6 <= left + 0.05, (sent.timeout_us, left)


def test_a_bug_in_a_reduce_is_internal_not_the_clients_fault_and_is_not_resent(made):
    """A ``reduce`` that raises numpy's "index 600 is out of bounds": INTERNAL naming the stage,
    no exception text for the client, no isolation re-run."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))

    def buggy(outputs):
        return {"LOGITS": outputs["LOGITS"][:, 600:601][np.array([600])]}

    orch.run = functools.partial(image_run, reduce=buggy)
    requests = [Request(image_inputs(), request_id=f"r{i}") for i in range(4)]
    pb.execute(orch, requests)
    wait_answered(requests)
    for request in requests:
        error = request.answer.error()
        assert error.code() == pb.TritonError.INTERNAL
        assert "stage 'classifier'" in error.message()
        assert "out of bounds" not in error.message() and "IndexError" not in error.message()
    assert sum(1 for model, _ in pb.calls if model == "classifier") == 1
    assert any("IndexError" in line for line in pb.log), "the details must reach the log"
    assert settled_metric(pb, "bls_subrequest_errors_total", kind="internal") >= 1
    assert pb.metric("bls_subrequest_errors_total", kind="invalid") == 0


def test_a_request_that_cannot_be_read_is_internal_not_invalid_arg(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pb.faults.plan("get_input_tensor_by_name", "once")
    request = Request(image_inputs())
    pb.execute(orch, [request])
    error = request.answer.error()
    assert error.code() == pb.TritonError.INTERNAL and "injected" not in error.message()


def footprint(orch) -> int:
    """Items in every unbounded container of the runtime's objects (and of the objects of
    bls_models they hold). The metrics are keyed by series, bounded by their labels
    (tests/unit/test_metrics.py); the threads by ``subrequest_threads`` and the clock's timers
    by the live ones (both asserted below)."""
    from bls_models.clock import Clock
    from bls_models.workers import Workers

    seen, total = set(), 0
    todo = [orch]
    while todo:
        thing = todo.pop()
        if id(thing) in seen:
            continue
        seen.add(id(thing))
        for value in (vars(thing) if hasattr(thing, "__dict__") else
                      {s: getattr(thing, s, None) for s in getattr(thing, "__slots__", ())}).values():
            if isinstance(value, deque) and value.maxlen is not None:
                continue  # a bounded window (recent batch times)
            if isinstance(value, (list, dict, set, deque)):
                total += len(value)
            elif (type(value).__module__.startswith("bls_models")
                  and not isinstance(value, (Metrics, Workers, Clock, type))):
                todo.append(value)
    return total


def test_an_orchestrators_state_does_not_grow_with_traffic(made):
    """After 40 and after 240 requests (a fresh ``functools.partial`` reduce per call, as a
    pipeline may pass; some slower than the hold), the runtime's containers hold the same."""
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb, return_within_ms="20"))

    def scaled(outputs, factor):
        return {"LOGITS": outputs["LOGITS"] * factor}

    orch.run = lambda inputs, call, setup: image_run(
        inputs, call, setup, reduce=functools.partial(scaled, factor=1.0))
    requests = []

    def send(count: int) -> None:
        for _ in range(count // 4):
            slow = "preprocess=30" if len(requests) % 20 == 0 else ""
            batch = [Request(image_of(20 + (len(requests) + v) % 100),
                             request_id=f"{len(requests)}.{v};{slow}") for v in range(4)]
            requests.extend(batch)
            pb.execute(orch, batch)
        wait_answered(requests, timeout=30)
        time.sleep(0.1)

    send(40)
    after_40 = footprint(orch)
    send(200)
    assert footprint(orch) == after_40
    assert len(orch.workers._threads) <= orch.config.subrequest_threads
    live = sum(not timer.cancelled for _, _, timer in orch.clock._heap)
    assert len(orch.clock._heap) <= 2 * live, "cancelled timers pile up"
    assert all(not r.answer.has_error() for r in requests)
    assert orch.answers.pending == set() and orch.admission.running == 0


def test_no_lock_is_held_across_a_round_trip_to_the_server(made):
    """``send``, ``is_cancelled`` and publishing metrics are IPC round trips in r24.10: the
    runtime's pb_utils lock is not held across them. (Every answer is sent here.)"""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, return_within_ms="0"))
    pb.forbidden_locks.append(orch.backend.lock)
    requests = [Request(image_inputs(), request_id=f"r{i};preprocess=0.05") for i in range(6)]
    pb.execute(orch, requests)
    wait_answered(requests)
    time.sleep(2 * FLUSH_SECONDS)
    assert pb.faults.calls["send"] == 6 and pb.faults.calls["is_cancelled"] >= 6
    assert pb.faults.calls["metric"] > 0
    assert pb.violations == []


def test_metrics_survive_a_failed_publication_and_lose_nothing(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pb.faults.plan("metric", "once")
    for round_ in range(3):
        requests = [Request(image_inputs(), request_id=f"{round_}.{i}") for i in range(5)]
        pb.execute(orch, requests)
        wait_answered(requests)
        time.sleep(2 * FLUSH_SECONDS)
    assert pb.faults.raised["metric"] == 1
    assert settled_metric(pb, "bls_requests_total", code="SUCCESS") == 15
    assert pb.metric("bls_inflight_requests") == 0


def test_shutdown_cleans_up_on_every_path_even_when_an_answer_is_slow_to_send(monkeypatch):
    """Answering at shutdown takes 1 s (a slow send): the threads still end, the metrics are
    published, finalize does not raise, and no pb_utils call happens after it."""
    from bls_models import triton_runtime

    monkeypatch.setattr(triton_runtime, "SHUTDOWN_DRAIN_SECONDS", 0.2)
    pb = FakePbUtils(sub_models())
    orch = orchestrator(pb, return_within_ms="20")
    stuck = Request(image_inputs(), request_id="classifier=0.6")
    stuck.sender.delay = 1.0
    pb.execute(orch, [stuck])
    pb.finalize(orch)
    assert len(stuck.answers) == 1
    assert stuck.answer.error().code() == pb.TritonError.UNAVAILABLE
    assert pb.metric("bls_requests_total", code="UNAVAILABLE") == 1, "metrics not published"
    time.sleep(0.6)
    assert pb.violations == []
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-")
                and t.is_alive() and "worker" not in t.name]


def test_a_sub_request_still_out_after_finalize_makes_no_pb_utils_call(monkeypatch):
    shorten_shutdown(monkeypatch, 0.1)
    pb = FakePbUtils(sub_models())
    orch, request = executing(pb, "embedder=0.8")
    time.sleep(0.05)
    pb.finalize(orch)
    assert request.answer.error().code() == pb.TritonError.UNAVAILABLE
    time.sleep(1.0)  # the embedder answers the thread left behind
    assert pb.violations == []


def test_answers_are_exact_rows_after_isolation_in_every_execute_call(made):
    """Groups of several calls, one with a poisoned row: the rows each success carries are its
    own (a regression guard for views of request memory kept past execute)."""
    from tests.unit.row_models import POISON, code_of

    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    values = [20, 21, POISON, 23, 24, 25]
    requests = [Request(image_of(v), request_id=f"r{i}") for i, v in enumerate(values)]
    for index in range(0, 6, 3):
        pb.execute(orch, requests[index:index + 3])
    wait_answered(requests)
    for request, value in zip(requests, values):
        if value == POISON:
            assert code_of(request.answer) == "INVALID_ARG"
        else:
            assert exact(request.answer, value)
