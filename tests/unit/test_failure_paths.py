"""The runtime's failure paths, one test (or two) per point of the review that found them
(issue 20: "Every request answered exactly once, whatever fails"), over the r24.10-like fake
``pb_utils`` (tests/unit/fake_pb_utils.py). Each failed on commit 671683a, the code reviewed.

The rule: every request that reaches ``execute`` gets exactly one final response, whatever
raises, within its deadline plus ``SLACK``, and nothing grows with traffic."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque

import numpy as np
import pytest

from bls_models import spec as S
from bls_models.metrics import FLUSH_SECONDS, HISTOGRAM_FLUSH_SECONDS, Metrics
from bls_models.workers import Workers
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.test_runtime import image, orchestrator, settled_metric, sub_models, wait_answered
from tests.unit.test_runtime_coalescing import RowModels, image_of

SLACK = 0.25  # what a busy 2-core host may add to a promise about time (tests/live/support.SLACK)


def answer(request: Request):
    """The one response that reached the client (fails if there are none or several)."""
    (response,) = request.answers
    return response


def execute_in_thread(pb, orch, requests) -> threading.Thread:
    """``execute`` from another thread (the stub's main thread may be held by backpressure)."""
    thread = threading.Thread(target=pb.execute, args=(orch, requests), daemon=True)
    thread.start()
    return thread


async def image_run(inputs, call, setup, reduce=None):
    """The pipeline's first stages, with ``reduce`` on the classifier's output."""
    pixels = (await call("preprocess", {"IMAGE": inputs["IMAGE"]}, ["PIXELS"]))["PIXELS"]
    logits = await call("classifier", {"PIXELS": pixels}, ["LOGITS"], reduce=reduce)
    embedding = (await call("embedder", {"PIXELS": pixels}, ["EMBEDDING"]))["EMBEDDING"]
    rows = len(inputs["IMAGE"])
    return {"CLASS_IDS": np.zeros((rows, S.TOP_K), np.int64),
            "CLASS_PROBS": np.zeros((rows, S.TOP_K), np.float32),
            "EMBEDDING": embedding, **logits}


# -- 1. a response that cannot be built ---------------------------------------------------------
@pytest.mark.parametrize("logger_fails", [False, True])
def test_1_a_response_that_cannot_be_built_is_answered_internal_and_frees_its_slot(
        made, logger_fails):
    """The run function leaves a declared output out for one kind of input (a data-dependent
    bug): that request is answered INTERNAL at once, with no exception text; the log has the
    details. Even with the logger failing, the slot comes back (one slot: the next request
    runs)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1", max_queued_requests="0",
                                     coalesce="on"))
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
    error = answer(bad).error()
    assert error.code() == pb.TritonError.INTERNAL
    assert "KeyError" not in error.message() and "EMBEDDING" not in error.message()
    assert not answer(good).has_error()
    assert settled_metric(pb, "bls_requests_total", code="INTERNAL") == 1
    if not logger_fails:
        assert any("no output 'EMBEDDING'" in line for line in pb.log)


# -- 2. deadlines count from arrival in execute ------------------------------------------------
@pytest.mark.parametrize("queued", ["0", "512"])
def test_2_a_request_waiting_for_a_slot_is_answered_when_its_deadline_passes(made, queued):
    """One slot, held 1 s by the first request. The second (200 ms deadline) waits for it —
    in execute (no queue in the orchestrator) or in the orchestrator's queue — and is answered
    at its deadline (UNAVAILABLE, saying why), not once the slot frees, and not with a fresh
    budget after it."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1", max_queued_requests=queued))
    blocker = Request(image(), request_id="classifier=1.0")
    late = Request(image(), request_id="late", timeout_us=200_000)
    pb.execute(orch, [blocker])
    sent = time.monotonic()
    execute_in_thread(pb, orch, [late])
    wait_answered([late], timeout=5)
    assert late.sender.answered_at - sent < 0.2 + SLACK
    error = answer(late).error()
    assert error.code() == pb.TritonError.UNAVAILABLE
    assert "waiting for one of its 1 slots" in error.message()
    wait_answered([blocker])
    assert not answer(blocker).has_error()
    assert settled_metric(pb, "bls_deadline_exceeded_total", stage="admission") == 1


@pytest.mark.parametrize("queued", ["0", "512"])
def test_2_the_deadline_and_the_latency_count_the_wait_for_a_slot(made, queued):
    """Requests of one batch that wait behind each other for the one slot: their deadline and
    their recorded latency start when execute got them, not when they got a slot."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_inflight_requests="1", max_queued_requests=queued))
    slow = Request(image(), request_id="classifier=0.5")
    follower = Request(image(), request_id="follower", timeout_us=700_000)
    sent = time.monotonic()
    pb.execute(orch, [slow, follower])
    wait_answered([slow, follower])
    # It got the slot at ~0.5 s with 0.2 s left: fine, it runs in a few ms.
    assert not answer(follower).has_error()
    assert follower.sender.answered_at - sent < 0.7
    time.sleep(HISTOGRAM_FLUSH_SECONDS + 2 * FLUSH_SECONDS)
    total = pb.metric("bls_request_latency_seconds_sum")
    assert pb.metric("bls_request_latency_seconds_count") == 2
    assert total >= 0.5 + 0.5 - 0.05, "the wait for the slot was not counted"


# -- 3. execute never raises ----------------------------------------------------------------------
@pytest.mark.parametrize("call", ["get_response_sender", "send"])
def test_3_execute_never_raises_and_answers_each_request_once(made, call):
    """``get_response_sender`` raising for one request: it is answered through execute's
    return value (INTERNAL), the others as usual. ``send`` raising for a request execute answers
    itself (here: a missing input): counted, and execute still returns normally."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    if call == "get_response_sender":
        requests = [Request(image(), request_id=f"r{i}") for i in range(3)]
        pb.faults.plan(call, "once", after=1)
    else:
        requests = [Request(image(), request_id="r0"),
                    Request({"PIXELS": np.zeros((1, 3), np.float32)}, request_id="unreadable"),
                    Request(image(), request_id="r2")]
        pb.faults.plan(call, "once")
    pb.execute(orch, requests)
    wait_answered(requests)
    time.sleep(0.1)
    assert pb.violations == []
    if call == "get_response_sender":
        assert answer(requests[1]).error().code() == pb.TritonError.INTERNAL
        assert requests[1].returned is not None and requests[1].sender.attempts == 0
        for request in (requests[0], requests[2]):
            assert not answer(request).has_error()
    else:
        assert requests[1].sender.attempts == 1 and requests[1].answers == []
        assert settled_metric(pb, "bls_requests_total", code="SEND_FAILED") == 1
        assert not answer(requests[0]).has_error() and not answer(requests[2]).has_error()


# -- 4. a coalesced group that raises -------------------------------------------------------------
def test_4_an_exception_inside_a_coalesced_group_settles_its_members_at_once(made):
    """Building a group's sub-request raises: every member is answered INTERNAL naming the stage
    at once, not after its deadline; the others are unaffected."""
    pb = FakePbUtils(RowModels(delay=0.05).models())
    made.append(orch := orchestrator(pb, coalesce="on", default_deadline_ms="3000"))
    blocker = Request(image_of(1), request_id="blocker")
    group = [Request(image_of(v), request_id=f"g{v}") for v in (2, 3, 4)]
    pb.execute(orch, [blocker])
    give_up = time.monotonic() + 5
    while not any(rid == "blocker" for _, rid in pb.calls) and time.monotonic() < give_up:
        time.sleep(0.001)  # until the blocker's preprocess is out: the group forms behind it
    pb.faults.plan("InferenceRequest", "once")
    started = time.monotonic()
    pb.execute(orch, group)
    wait_answered([blocker, *group], timeout=5)
    assert max(r.sender.answered_at for r in group) - started < 1.0
    failed = [r for r in group if answer(r).has_error()]
    assert failed, "the fault hit no sub-request"
    for request in failed:
        assert answer(request).error().code() == pb.TritonError.INTERNAL
        assert "in stage '" in answer(request).error().message()
    assert pb.faults.raised["InferenceRequest"] == 1


# -- 5. sub-request timeouts are computed when a thread sends them ---------------------------------
def test_5_a_sub_requests_timeout_is_the_budget_left_when_it_is_sent(made):
    """One sub-request thread, held 0.5 s by the first request: the second's preprocess waits
    for it, and its Triton timeout is what is left of its 2 s then, not 2 s."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, subrequest_threads="1"))
    first = Request(image(), request_id="first;preprocess=0.5")
    second = Request(image(), request_id="second", timeout_us=2_000_000)
    arrived = time.monotonic()
    pb.execute(orch, [first, second])
    wait_answered([first, second])
    (sent,) = [s for s in pb.sent if s.model == "preprocess" and s.request_id == "second"]
    left = arrived + 2.0 - sent.started
    assert sent.started - arrived > 0.4
    assert sent.timeout_us / 1e6 <= left + 0.05, (sent.timeout_us, left)


def test_5_a_coalesced_member_that_expired_before_its_group_was_sent_is_never_sent(made):
    """Both sub-request threads are held 0.5 s by the first request; the next two requests,
    taken by one execute, start together and their preprocess parts go as one group, which
    waits for a thread. The one with a 0.2 s deadline expires meanwhile: it is answered on time
    and left out of the group's sub-request."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, coalesce="on", subrequest_threads="2"))
    first = Request(image(), request_id="first;classifier=0.5;embedder=0.5")
    pb.execute(orch, [first])
    time.sleep(0.1)  # its two branches hold both threads
    patient = Request(image(), request_id="patient", timeout_us=3_000_000)
    hasty = Request(image(), request_id="hasty", timeout_us=200_000)
    sent = time.monotonic()
    pb.execute(orch, [patient, hasty])
    wait_answered([first, patient, hasty], timeout=5)
    assert hasty.sender.answered_at - sent < 0.2 + SLACK
    assert answer(hasty).error().code() == pb.TritonError.UNAVAILABLE
    assert not answer(patient).has_error()
    preprocess_ids = [s.request_id for s in pb.sent if s.model == "preprocess"]
    assert "patient" in preprocess_ids and not any("hasty" in i for i in preprocess_ids)
    time.sleep(HISTOGRAM_FLUSH_SECONDS + 2 * FLUSH_SECONDS)
    groups = pb.metric("bls_coalesced_group_size_count", stage="preprocess")
    members = pb.metric("bls_coalesced_group_size_sum", stage="preprocess")
    assert (groups, members) == (2, 3), "patient and hasty did not go as one group"


# -- 6. a sick stage is not hammered ----------------------------------------------------------------
@pytest.mark.parametrize("coalesce", ["on", "off"])
def test_6_a_stage_failing_every_request_gets_at_most_one_sub_request_per_request(made, coalesce):
    """The embedder fails every request with an error no item caused (a model failing, e.g.
    out of memory): no request is re-sent to it, and every client gets its error promptly."""
    models = sub_models()

    def sick(inputs, request):
        from tests.unit.fake_pb_utils import SubModelError
        raise SubModelError("onnx runtime error 6: Failed to allocate memory for requested "
                            "buffer of size 602112")

    models["embedder"] = sick
    pb = FakePbUtils(models)
    made.append(orch := orchestrator(pb, coalesce=coalesce))
    requests = [Request(image(), request_id=f"r{i}") for i in range(40)]
    started = time.monotonic()
    for index in range(0, 40, 4):
        pb.execute(orch, requests[index:index + 4])
    wait_answered(requests)
    assert max(r.sender.answered_at for r in requests) - started < 2.0
    for request in requests:
        error = answer(request).error()
        assert error.code() == pb.TritonError.INTERNAL and "stage 'embedder'" in error.message()
    assert sum(1 for model, _ in pb.calls if model == "embedder") <= 40


# -- 7. the orchestrator's own failures are INTERNAL, never the client's fault --------------------
@pytest.mark.parametrize("coalesce", ["on", "off"])
def test_7_a_bug_in_a_reduce_is_internal_not_the_clients_fault_and_is_not_resent(made, coalesce):
    """A ``reduce`` that raises numpy's "index 600 is out of bounds": INTERNAL naming the stage,
    no exception text for the client, no isolation re-send."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, coalesce=coalesce))

    def buggy(outputs):
        return {"LOGITS": outputs["LOGITS"][:, 600:601][np.array([600])]}

    orch.run = functools.partial(image_run, reduce=buggy)
    requests = [Request(image(), request_id=f"r{i}") for i in range(4)]
    pb.execute(orch, requests)
    wait_answered(requests)
    for request in requests:
        error = answer(request).error()
        assert error.code() == pb.TritonError.INTERNAL
        assert "stage 'classifier'" in error.message()
        assert "out of bounds" not in error.message() and "IndexError" not in error.message()
    assert sum(1 for model, _ in pb.calls if model == "classifier") <= 4
    assert any("IndexError" in line for line in pb.log), "the details must reach the log"
    assert settled_metric(pb, "bls_subrequest_errors_total", kind="internal") >= 1
    assert pb.metric("bls_subrequest_errors_total", kind="invalid") == 0


def test_7_a_request_that_cannot_be_read_is_internal_not_invalid_arg(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pb.faults.plan("get_input_tensor_by_name", "once")
    request = Request(image())
    pb.execute(orch, [request])
    wait_answered([request])
    error = answer(request).error()
    assert error.code() == pb.TritonError.INTERNAL and "injected" not in error.message()


# -- 8. nothing grows with traffic --------------------------------------------------------------------
def test_8_an_orchestrators_state_does_not_grow_with_traffic(made):
    """After 40 and after 240 requests (coalescing, a fresh ``functools.partial`` reduce per
    call as a pipeline may pass), the runtime's containers hold the same: no per-group record,
    no queue per reduce object; and the fresh partials still coalesce."""
    pb = FakePbUtils(RowModels(delay=0.005).models())
    made.append(orch := orchestrator(pb, coalesce="on"))

    def scaled(outputs, factor):
        return {"LOGITS": outputs["LOGITS"] * factor}

    orch.run = lambda inputs, call, setup: image_run(
        inputs, call, setup, reduce=functools.partial(scaled, factor=1.0))

    def footprint() -> int:
        """Items in every unbounded container of the runtime's objects (and of the objects of
        bls_models they hold: e.g. a coalescer's record of groups). The metrics are keyed by
        series, which are bounded by their labels (tests/unit/test_metrics.py); the sub-request
        threads by ``subrequest_threads`` (asserted below)."""
        seen, total = set(), 0
        todo = [orch, orch.responder, orch.subrequests, *orch.subrequests.coalescers.values()]
        while todo:
            thing = todo.pop()
            if id(thing) in seen:
                continue
            seen.add(id(thing))
            for value in vars(thing).values():
                if isinstance(value, deque) and value.maxlen is not None:
                    continue  # a bounded window (e.g. recent durations)
                if isinstance(value, (list, dict, set, deque)):
                    total += len(value)
                elif (type(value).__module__.startswith("bls_models")
                      and hasattr(value, "__dict__")
                      and not isinstance(value, (Metrics, Workers))):
                    todo.append(value)
        return total

    requests = []

    def send(count: int) -> None:
        for _ in range(count // 4):
            batch = [Request(image_of(20 + (len(requests) + v) % 100), request_id=f"{len(requests)}.{v}")
                     for v in range(4)]
            requests.extend(batch)
            pb.execute(orch, batch)
        wait_answered(requests, timeout=30)
        time.sleep(0.1)

    send(40)
    after_40 = footprint()
    send(200)
    assert footprint() == after_40
    assert len(orch.subrequests.workers._threads) <= orch.config.subrequest_threads
    assert all(not answer(r).has_error() for r in requests)
    classifier = [s.rows for s in pb.sent if s.model == "classifier"]
    assert max(classifier) > 1, "fresh reduce objects stopped coalescing"


# -- 10. no lock across a round trip; metrics survive their own failure ----------------------------
def test_10_no_lock_is_held_across_a_round_trip_to_the_server(made):
    """``send``, ``is_cancelled`` and publishing metrics are IPC round trips in r24.10: the
    runtime's pb_utils lock is not held across them. (Every answer is sent here, none returned
    from execute.)"""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, return_within_ms="0"))
    pb.forbidden_locks.append(orch.lock)
    requests = [Request(image(), request_id=f"r{i}") for i in range(6)]
    pb.execute(orch, requests)
    wait_answered(requests)
    time.sleep(2 * FLUSH_SECONDS)
    assert pb.faults.calls["send"] == 6 and pb.faults.calls["is_cancelled"] >= 6
    assert pb.faults.calls["metric"] > 0
    assert pb.violations == []


def test_10_metrics_survive_a_failed_publication_and_lose_nothing(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pb.faults.plan("metric", "once")
    for round_ in range(3):
        requests = [Request(image(), request_id=f"{round_}.{i}") for i in range(5)]
        pb.execute(orch, requests)
        wait_answered(requests)
        time.sleep(2 * FLUSH_SECONDS)
    assert pb.faults.raised["metric"] == 1
    assert settled_metric(pb, "bls_requests_total", code="SUCCESS") == 15
    assert pb.metric("bls_inflight_requests") == 0


# -- 11. shutdown ------------------------------------------------------------------------------------
def test_11_shutdown_cleans_up_on_every_path_even_when_cancelling_times_out(monkeypatch):
    """Cancelling at shutdown outlasts its bound (the loop is stuck 1 s in a slow send): the loop
    still stops, the threads end, the metrics are published, finalize does not raise, and no
    pb_utils call happens after it."""
    from bls_models import triton_runtime

    monkeypatch.setattr(triton_runtime, "SHUTDOWN_DRAIN_SECONDS", 0.2)
    monkeypatch.setattr(triton_runtime, "SHUTDOWN_CANCEL_SECONDS", 0.2)
    pb = FakePbUtils(sub_models())
    orch = orchestrator(pb)
    stuck = Request(image(), request_id="classifier=0.6")
    stuck.sender.delay = 1.0  # its answer takes the event loop 1 s
    pb.execute(orch, [stuck])
    pb.finalize(orch)
    assert len(stuck.answers) == 1
    assert answer(stuck).error().code() == pb.TritonError.UNAVAILABLE
    assert not orch.thread.is_alive() and orch.loop.is_closed()
    assert pb.metric("bls_requests_total", code="UNAVAILABLE") == 1, "metrics not published"
    time.sleep(0.6)
    assert pb.violations == []
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-")]


def test_11_a_sub_request_still_out_after_finalize_makes_no_pb_utils_call(monkeypatch):
    from bls_models import triton_runtime

    monkeypatch.setattr(triton_runtime, "SHUTDOWN_DRAIN_SECONDS", 0.1)
    monkeypatch.setattr(triton_runtime, "SHUTDOWN_THREADS_SECONDS", 0.1)
    pb = FakePbUtils(sub_models())
    orch = orchestrator(pb)
    request = Request(image(), request_id="embedder=0.8")
    pb.execute(orch, [request])
    time.sleep(0.05)
    pb.finalize(orch)
    assert answer(request).error().code() == pb.TritonError.UNAVAILABLE
    time.sleep(1.0)  # the embedder answers the thread left behind
    assert pb.violations == []
