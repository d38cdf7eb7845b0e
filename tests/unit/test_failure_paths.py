"""The runtime's failure paths over the r24.10-like fake ``pb_utils`` (tests/unit/fake_pb_utils.py),
each named after what it holds to: a bug of the orchestrator's own is INTERNAL for the requests
it touches and is never re-sent, a failed publication loses no count, shutdown cleans up
whatever failed, and nothing grows with traffic. After each test the fake checks the runtime's
invariants: every request answered exactly once, before ``execute`` returned, on time
(tests/unit/conftest.py). The normal path, deadlines and cancellation are in test_runtime.py,
isolation in test_isolation.py."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from bls_models import spec as S
from bls_models.drive import Pool
from bls_models.metrics import FLUSH_SECONDS, Metrics
from tests.helpers import (
    SLACK,
    counted,
    image_inputs,
    orchestrator,
    settled_metric,
    shorten_shutdown,
    sub_models,
)
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import POISON, DirectedRowModels, code_of, expect_exact, image_of

# Under the committed (CPU) configs and the GPU profile: tests/unit/conftest.py.
pytestmark = pytest.mark.usefixtures("profile")


def rows_models() -> FakePbUtils:
    pb = FakePbUtils(DirectedRowModels().models())
    expect_exact(pb)
    return pb


async def image_run(inputs, call, setup, reduce=None):
    """The pipeline's stages one after the other, with ``reduce`` on the classifier's output."""
    pixels = (await call("preprocess", {"IMAGE": inputs["IMAGE"]}, ["PIXELS"]))["PIXELS"]
    logits = await call("classifier", {"PIXELS": pixels}, ["LOGITS"], reduce=reduce)
    embedding = (await call("embedder", {"PIXELS": pixels}, ["EMBEDDING"]))["EMBEDDING"]
    rows = len(inputs["IMAGE"])
    return {"CLASS_IDS": np.zeros((rows, S.TOP_K), np.int64),
            "CLASS_PROBS": np.zeros((rows, S.TOP_K), np.float32),
            "EMBEDDING": embedding, **logits}


# -- a bug of the orchestrator's own ------------------------------------------------------------
@pytest.mark.parametrize("logger_fails", [False, True])
def test_a_bug_of_the_run_function_is_internal_for_its_group_and_never_bisected(
        made, logger_fails):
    """The run function leaves a declared output out for one kind of input (a data-dependent
    bug): its group is answered INTERNAL with no exception text, and never re-run in parts (a
    bug is no row's fault: re-running would only multiply the sub-requests); the log has the
    details. Even with the logger failing, every request is answered and the next batch runs."""
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    pipeline = orch.run

    async def leaves_embedding_out(inputs, call, setup):
        outputs = await pipeline(inputs, call, setup)
        if (inputs["IMAGE"] == 7).reshape(len(inputs["IMAGE"]), -1).all(axis=1).any():
            del outputs["EMBEDDING"]
        return outputs

    orch.run = leaves_embedding_out
    if logger_fails:
        pb.faults.plan("Logger", "always")
    bad, good = Request(image_of(7), request_id="bad"), Request(image_of(8), request_id="good")
    pb.execute(orch, [bad, good])
    for request in (bad, good):
        error = request.answer.error()
        assert error.code() == pb.TritonError.INTERNAL
        assert "ValueError" not in error.message() and "EMBEDDING" not in error.message()
    assert [model for model, _ in pb.calls].count("preprocess") == 1, "the bug was bisected"
    assert counted(pb, orch, "bls_isolated_requests_total") == 0
    after = Request(image_of(9), request_id="after")
    pb.execute(orch, [after])
    assert not after.answer.has_error()
    assert settled_metric(pb, "bls_requests_total", code="INTERNAL") == 2
    if not logger_fails:
        assert any("no output 'EMBEDDING'" in line for line in pb.log)


def test_an_exception_building_a_groups_sub_request_answers_its_members_at_once(made):
    """Building a group's sub-request raises: every member is answered INTERNAL naming the stage
    at once, not at its deadline, and never re-run (the orchestrator's own failure)."""
    pb = rows_models()
    made.append(orch := orchestrator(pb, default_deadline_ms="3000"))
    group = [Request(image_of(v), request_id=f"g{v}") for v in (2, 3, 4)]
    pb.faults.plan("InferenceRequest", "once", after=1)
    started = time.monotonic()
    pb.execute(orch, group)
    assert all(r.returned is not None for r in group)
    assert time.monotonic() - started < 1.0
    for request in group:
        assert request.answer.error().code() == pb.TritonError.INTERNAL
        assert "in stage '" in request.answer.error().message()
    assert pb.faults.raised["InferenceRequest"] == 1
    assert len(pb.calls) <= 3
    assert settled_metric(pb, "bls_isolated_requests_total") == 0


def test_a_bug_in_a_reduce_is_internal_not_the_clients_fault_and_is_not_resent(made):
    """A ``reduce`` that raises numpy's "index 600 is out of bounds" (a message the error
    classifier would call the client's): INTERNAL naming the stage, no exception text for the
    client, no isolation re-run."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))

    def buggy(outputs):
        return {"LOGITS": outputs["LOGITS"][:, 600:601][np.array([600])]}

    orch.run = functools.partial(image_run, reduce=buggy)
    requests = [Request(image_inputs(), request_id=f"r{i}") for i in range(4)]
    pb.execute(orch, requests)
    for request in requests:
        error = request.answer.error()
        assert error.code() == pb.TritonError.INTERNAL
        assert "stage 'classifier'" in error.message()
        assert "out of bounds" not in error.message() and "IndexError" not in error.message()
    assert sum(1 for model, _ in pb.calls if model == "classifier") == 1
    assert any("IndexError" in line for line in pb.log), "the details must reach the log"
    assert settled_metric(pb, "bls_subrequest_errors_total", kind="internal") == 1
    assert pb.metric("bls_subrequest_errors_total", kind="invalid") == 0


@pytest.mark.parametrize("where", ["reading the second request", "forming the groups"])
def test_a_bug_in_execute_itself_answers_every_request_internal(made, monkeypatch, where):
    """``execute`` must not raise (r24.10 then deletes every response factory, answered ones
    included): whatever its own code raises, every request of the batch, read or not yet, is
    answered INTERNAL from its list, and the next batch runs."""
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    if where == "forming the groups":
        from bls_models.group import Group

        monkeypatch.setattr(Group, "form", staticmethod(lambda *args: 1 / 0))
    else:
        receive, seen = orch._receive, []

        def fails_second(request, arrived):
            seen.append(request)
            if len(seen) == 2:
                raise ZeroDivisionError("a bug")
            return receive(request, arrived)

        monkeypatch.setattr(orch, "_receive", fails_second)
    requests = [Request(image_of(v), request_id=f"e{v}") for v in (2, 3, 4)]
    returned = pb.execute(orch, requests)
    assert all(response is not None for response in returned)
    assert [code_of(r.answer) for r in requests] == ["INTERNAL"] * 3
    assert any("execute failed" in line and "ZeroDivisionError" in line for line in pb.log)
    monkeypatch.undo()
    after = Request(image_of(5), request_id="after")
    pb.execute(orch, [after])
    assert not after.answer.has_error()


# -- answers sent while the batch runs -----------------------------------------------------------
def test_a_send_that_raises_once_loses_only_its_own_answer(made):
    """Three members past their deadline while a fourth still runs are sent at once; the first
    send raises (r24.10 has closed the sender: that answer is lost, counted SEND_FAILED) and the
    others are sent all the same (nothing owed: the keeper's answer comes in execute's list)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_owed_answers="0"))
    requests = [Request(image_inputs(), request_id=f"r{i};classifier=0.3", timeout_us=100_000)
                for i in range(3)]
    keeper = Request(image_inputs(), request_id="keeper", timeout_us=1_000_000)
    pb.faults.plan("send", "once")
    pb.execute(orch, requests + [keeper])
    assert not keeper.answer.has_error() and not keeper.sender.attempts
    lost = [r for r in requests if not r.answers]
    assert len(lost) == 1 and lost[0].sender.attempts == 1
    assert [code_of(r.answer) for r in requests if r not in lost] == ["UNAVAILABLE"] * 2
    assert settled_metric(pb, "bls_requests_total", code="SEND_FAILED") == 1
    pb.executed.remove(lost[0])  # r24.10 leaves no way to answer it: not the runtime's fault


def test_a_send_under_way_holds_executes_return(made):
    """An answer sent at its deadline while a batch-mate still runs takes 0.3 s to send (a slow
    round trip): ``execute`` returns only once it is done, so nothing is owed, or uses a
    request, after ``execute`` returned (``max_owed_answers`` 0)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_owed_answers="0"))
    slow = Request(image_inputs(), request_id="slow;classifier=0.15", timeout_us=100_000)
    keeper = Request(image_inputs(), request_id="keeper", timeout_us=2_000_000)
    slow.sender.delay = 0.3
    started = time.monotonic()
    pb.execute(orch, [slow, keeper])
    assert slow.sender.sent, "execute returned while its answer was still being sent"
    assert time.monotonic() - started >= 0.1 + 0.3
    assert code_of(slow.answer) == "UNAVAILABLE"
    assert not keeper.answer.has_error()


@pytest.mark.parametrize("call", ["get_response_sender", "InferenceResponse", "Tensor",
                                  "TritonError"])
def test_an_answer_that_cannot_be_built_or_handed_over_early_is_still_given(call):
    """Only a ``send`` that raises has closed its sender (r24.10): when an early answer cannot
    be built, or its sender got, once, the request must still be answered (INTERNAL at
    worst), as ``execute``'s own list does. Sent early: a success ready at its deadline
    (``early``, while the other group runs) or a deadline error (``TritonError``)."""
    pb = rows_models()
    orch = orchestrator(pb, max_owed_answers="0")  # early sends while execute holds the batch
    send = orch._send

    def faulty_send(job, **how):  # the next such call raises, whatever the timing
        pb.faults.plan(call, "once")
        return send(job, **how)

    orch._send = faulty_send
    try:
        if call == "TritonError":
            early = Request(image_of(3), request_id="early;classifier=300", timeout_us=100_000)
            batch = [early, Request(image_of(4), request_id="keeper", timeout_us=2_000_000)]
        else:
            early = Request(image_of(3, 10), request_id="early", timeout_us=100_000)
            batch = [early, Request(image_of(4, 10), request_id="slow;classifier=300")]
        pb.execute(orch, batch)
    finally:
        pb.finalize(orch)
    assert pb.faults.raised[call] == 1
    assert early.sender.attempts == 0 or early.answers, "a send that raised: not this case"
    assert len(early.answers) == 1, f"lost although its sender was never used ({call})"
    assert pb.check() == []


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics_survive_a_failed_publication_and_lose_nothing():
    """A publication fails once: what it did not publish goes out with the next one; the
    latency histogram (published every HISTOGRAM_FLUSH_SECONDS, and at finalize) counts every
    request from its arrival in ``execute``."""
    pb = FakePbUtils(sub_models())
    orch = orchestrator(pb)
    try:
        pb.faults.plan("metric", "once")
        for round_ in range(3):
            requests = [Request(image_inputs(), request_id=f"{round_}.{i};preprocess=0.05")
                        for i in range(5)]
            pb.execute(orch, requests)
            time.sleep(2 * FLUSH_SECONDS)
        assert pb.faults.raised["metric"] == 1
        assert settled_metric(pb, "bls_requests_total", code="SUCCESS") == 15
        assert pb.metric("bls_inflight_requests") == 0
    finally:
        pb.finalize(orch)
    assert pb.metric("bls_request_latency_seconds_count") == 15
    assert pb.metric("bls_request_latency_seconds_sum") >= 15 * 0.05
    assert pb.check() == []


# -- shutdown ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["clean", "publishing fails", "logging fails",
                                  "a thread stuck past the drain"])
def test_shutdown_cleans_up_on_every_path(monkeypatch, path):
    """Whatever fails at finalize, it returns, the metrics' and the pool's threads end (a thread
    blocked in a sub-model is left to the process's exit), the metrics are published when they
    can be, and no pb_utils call happens after finalize."""
    # Two groups of 10 rows: the second runs on the pool, its member is answered at its 100 ms
    # deadline while its classifier is still out: 150 ms, done within the drain; stuck, 2 s,
    # past a 0.2 s drain however slow the host (0.6 s once was not, under a loaded CI host).
    stuck_path = path == "a thread stuck past the drain"
    drain = 0.2 if stuck_path else 1.0  # finalize waits only as long as a thread is out
    shorten_shutdown(monkeypatch, drain)
    pb = rows_models()
    orch = orchestrator(pb)
    delay = 2000 if stuck_path else 150
    requests = [Request(image_of(1, 10), request_id="first"),
                Request(image_of(2, 10), request_id=f"second;classifier={delay}",
                        timeout_us=100_000)]
    pb.execute(orch, requests)
    if path == "publishing fails":
        pb.faults.plan("metric", "always")
    elif path == "logging fails":
        pb.faults.plan("Logger", "always")
    started = time.monotonic()
    pb.finalize(orch)
    assert time.monotonic() - started < 2 * drain + 0.2 + SLACK
    assert not orch.metrics._thread.is_alive()
    stuck = [thread for thread in orch.pool._threads if thread.is_alive()]
    assert len(stuck) == (1 if stuck_path else 0)
    if path != "publishing fails":
        assert pb.metric("bls_requests_total") == 2, "the last metrics were not published"
        assert pb.metric("bls_deadline_exceeded_total") == 1
    for thread in stuck:  # a stuck classifier answers: the thread makes no pb_utils call
        thread.join(timeout=delay / 1e3 + 5.0)
    assert not any(thread.is_alive() for thread in orch.pool._threads)
    assert pb.violations == [] and pb.check() == []
    assert [code_of(r.answer) for r in requests] == ["SUCCESS", "UNAVAILABLE"]


# -- isolation in every execute call, and what must not grow -------------------------------------
def test_answers_are_exact_rows_after_isolation_in_every_execute_call(made):
    """Three execute calls of two groups each (16 rows at most: the second runs on the pool),
    each group with a poisoned request: every other request gets exactly its own rows, in every
    call (the fake overwrites a request's memory when execute returns)."""
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    requests = []
    for call in range(3):
        values = [20 + 10 * call + i for i in range(4)]
        batch = [Request(image_of(values[0], 6), request_id=f"c{call}a"),
                 Request(image_of(values[1], 6), request_id=f"c{call}b"),
                 Request(image_of(POISON), request_id=f"c{call}p"),
                 Request(image_of(values[2], 6), request_id=f"c{call}c"),
                 Request(image_of(values[3], 6), request_id=f"c{call}d"),
                 Request(image_of(POISON), request_id=f"c{call}q")]
        pb.execute(orch, batch)
        requests += batch
    assert [code_of(r.answer) for r in requests] == (
        ["SUCCESS", "SUCCESS", "INVALID_ARG"] * 6)
    assert settled_metric(pb, "bls_isolated_requests_total") == 3 * 6


def footprint(orch) -> int:
    """Items in every container of the runtime's objects (and of the objects of bls_models they
    hold). The metrics are keyed by series, bounded by their labels (tests/unit/test_metrics.py);
    the pool's threads by ``subrequest_threads`` (asserted below)."""
    seen, total = set(), 0
    todo = [orch]
    while todo:
        thing = todo.pop()
        if id(thing) in seen:
            continue
        seen.add(id(thing))
        for value in (vars(thing) if hasattr(thing, "__dict__") else
                      {s: getattr(thing, s, None) for s in getattr(thing, "__slots__", ())}).values():
            if isinstance(value, (list, dict, set)):
                total += len(value)
            elif (type(value).__module__.startswith("bls_models")
                  and not isinstance(value, (Metrics, Pool, type))):
                todo.append(value)
    return total


def test_no_container_of_the_runtime_grows_with_traffic(made):
    """After 40 and after 240 requests (a fresh ``functools.partial`` reduce per run, as a
    pipeline may pass; some past their deadline, some poisoned and isolated), every container
    of the runtime's objects holds the same: nothing is kept per request, batch, group or
    reduce."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))

    def scaled(outputs, factor):
        return {"LOGITS": outputs["LOGITS"] * factor}

    orch.run = lambda inputs, call, setup: image_run(
        inputs, call, setup, reduce=functools.partial(scaled, factor=1.0))
    sent = []

    def traffic(count: int) -> None:
        for _ in range(count // 4):
            n = len(sent)
            late = n % 40 == 0
            batch = [Request(image_of(POISON if (n + v) % 37 == 0 else 20 + (n + v) % 100),
                             request_id=f"{n}.{v}" + (";classifier=60" if late else ""),
                             timeout_us=30_000 if late and v == 0 else 0)
                     for v in range(4)]
            sent.extend(batch)
            pb.execute(orch, batch)
        # The late requests' classifiers (60 ms, past their 30 ms deadline) return after their
        # answers, and on a loaded host a slow batch's answers are owed past execute: wait until
        # nothing is out or owed (a fixed 0.1 s alone was too short on a loaded CI host), then
        # 0.1 s for the threads that cleared them to return to the pool.
        eventually(lambda: not (orch.out or orch.inflight or orch.owed))
        time.sleep(0.1)

    traffic(40)
    after_40 = footprint(orch)
    traffic(200)
    assert footprint(orch) == after_40
    assert len(orch.pool._threads) <= orch.config.subrequest_threads
    assert orch.out == set()
    codes = {code_of(r.answer) for r in sent}
    assert codes == {"SUCCESS", "INVALID_ARG", "UNAVAILABLE"}, codes


# -- answers and counts that tell the truth -------------------------------------------------------
def overflowing_digits(inputs, request):
    """A digits model that overflows as a real one does on a finite but huge pixel: exp(-3e38)
    is 0, and 0 / 0 is NaN."""
    z = inputs["DIGIT_PIXELS"][:, :10].astype(np.float32) / 16
    with np.errstate(all="ignore"):
        e = np.exp(z)
        return {"DIGIT_PROBS": (e / e.sum(axis=1, keepdims=True)).astype(np.float32)}


def test_an_output_driven_to_nan_fails_its_own_request_alone(made):
    """``DIGIT_PIXELS`` of -3e38 is finite, so the input check lets it in; both digits models
    answer NaN for it. That request is INVALID_ARG naming the output and its inputs; its
    group-mates get their answers."""
    pb = FakePbUtils({"digits_small": overflowing_digits, "digits_large": overflowing_digits})
    made.append(orch := orchestrator(pb, "digits_cascade"))
    good = np.full((1, 64), 4.0, np.float32)
    huge = np.full((1, 64), -3e38, np.float32)
    requests = [Request({"DIGIT_PIXELS": x}, request_id=f"d{i}")
                for i, x in enumerate((good, huge, good))]
    pb.execute(orch, requests)
    assert [code_of(r.answer) for r in requests] == ["SUCCESS", "INVALID_ARG", "SUCCESS"]
    message = requests[1].answer.error().message()
    assert "DIGIT_PROB" in message and "DIGIT_PIXELS" in message and "nan" in message
    for request in (requests[0], requests[2]):
        assert all(np.isfinite(t.as_numpy()).all() for t in request.answer.output_tensors
                   if t.as_numpy().dtype.kind == "f")


def test_an_output_the_contract_lets_be_non_finite_is_answered_as_it_is(made):
    from dataclasses import replace

    from bls_models.spec import registered

    pb = FakePbUtils({"digits_small": overflowing_digits, "digits_large": overflowing_digits})
    definition = replace(registered("digits_cascade"), non_finite=("DIGIT_PROB",))
    made.append(orch := orchestrator(pb, "digits_cascade", pipeline=definition))
    pixels = np.full((1, 64), -3e38, np.float32)
    request = Request({"DIGIT_PIXELS": pixels}, request_id="nan-allowed")
    pb.execute(orch, [request])
    probs = {t.name(): t.as_numpy() for t in request.answer.output_tensors}["DIGIT_PROB"]
    assert np.isnan(probs).all()
    with pytest.raises(ValueError, match="non_finite"):
        replace(definition, non_finite=("NO_SUCH",))


def eventually(condition, seconds: float = 5.0) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (polled): what a busy host may delay."""
    give_up = time.monotonic() + seconds
    while not condition() and time.monotonic() < give_up:
        time.sleep(0.02)
    return condition()


def test_a_cancellation_is_counted_as_one_not_as_a_deadline(made):
    """The client has left while its classifier is out (1 s): CANCELLED at the first check,
    and the abandoned sub-request is counted under kind "cancelled", not "deadline"."""
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    request = Request(image_of(3), request_id="gone;classifier=1000")
    request.sender.cancelled.set()
    pb.execute(orch, [request])
    assert code_of(request.answer) == "CANCELLED"
    assert eventually(lambda: counted(pb, orch, "bls_abandoned_subrequests_completed_total") >= 1)
    assert counted(pb, orch, "bls_subrequest_errors_total", kind="cancelled") >= 1
    assert counted(pb, orch, "bls_subrequest_errors_total", kind="deadline") == 0
    assert counted(pb, orch, "bls_deadline_exceeded_total") == 0
    assert counted(pb, orch, "bls_abandoned_subrequests_total") == counted(
        pb, orch, "bls_abandoned_subrequests_completed_total")


def test_a_sub_models_queue_timeout_is_counted_as_a_deadline_exceeded(made):
    """A sub-model's queue policy expires the sub-request ("Request timeout expired", core
    r24.10 ``dynamic_batch_scheduler.cc`` 71): each request of the group hears a deadline and is
    counted in ``bls_deadline_exceeded_total``, as one its own deadline ended is."""
    pb = FakePbUtils(DirectedRowModels(sick={"classifier": "Request timeout expired"}).models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v), request_id=f"q{v}") for v in (3, 4)]
    pb.execute(orch, requests)
    assert [code_of(r.answer) for r in requests] == ["UNAVAILABLE"] * 2
    assert "deadline exceeded in stage 'classifier'" in requests[0].answer.error().message()
    assert counted(pb, orch, "bls_deadline_exceeded_total", stage="classifier") == 2


def test_an_isolation_attempt_past_its_stage_timeout_is_counted_abandoned(made):
    """A poisoned row; the attempt for the first half waits on a slow embedder past
    ``embedder_timeout_ms``: its members hear the deadline while the others are still being
    isolated. That sub-request is counted abandoned once, and completed when it comes back:
    completions never exceed abandonments."""
    models = DirectedRowModels(poisoned_stages=("embedder",)).models()
    embedder = models["embedder"]

    def slow_for_the_first_half(inputs, request):
        if request.request_id == "r20,r21":
            time.sleep(0.5)
        return embedder(inputs, request)

    models["embedder"] = slow_for_the_first_half
    pb = FakePbUtils(models)
    made.append(orch := orchestrator(pb, embedder_timeout_ms="200"))
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21, POISON, 23)]
    pb.execute(orch, requests)
    assert [code_of(r.answer) for r in requests] == ["UNAVAILABLE", "UNAVAILABLE",
                                                     "INVALID_ARG", "SUCCESS"]
    assert eventually(lambda: counted(pb, orch, "bls_abandoned_subrequests_completed_total",
                                      stage="embedder") >= 1)
    abandoned = counted(pb, orch, "bls_abandoned_subrequests_total", stage="embedder")
    completed = counted(pb, orch, "bls_abandoned_subrequests_completed_total", stage="embedder")
    assert abandoned == completed == 1
