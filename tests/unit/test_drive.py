"""The driver of run functions (``bls_models.drive``), with no Triton: which sub-requests a run
function hands to ``send`` and in which order, gathered branches on a bounded ``Pool`` (inline
when it refuses), how failures come back, and the pool's own bound."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from bls_models import drive
from bls_models.drive import Abandoned, Call, Pool
from bls_models.drive import Gather as gather
from bls_models.errors import Code, PipelineError


def pool(size: int, log: list | None = None) -> Pool:
    return Pool(size, "test", lambda message, error=False: (log if log is not None else [])
                .append(message))


@pytest.fixture
def pools():
    """Pools a test made, shut down afterwards."""
    made: list[Pool] = []
    yield made
    for made_pool in made:
        made_pool.shutdown(1.0)


class Recorder:
    """A ``send`` answering each stage after ``delays[stage]`` s, recording (stage, start, end,
    thread) of each call."""

    def __init__(self, delays=None, answers=None, fail=None) -> None:
        self.delays, self.answers, self.fail = delays or {}, answers or {}, fail or {}
        self.log: list[tuple[str, float, float, str]] = []
        self.lock = threading.Lock()

    def __call__(self, call: Call):
        started = time.monotonic()
        time.sleep(self.delays.get(call.stage, 0.0))
        with self.lock:
            self.log.append((call.stage, started, time.monotonic(),
                             threading.current_thread().name))
        if call.stage in self.fail:
            raise self.fail[call.stage]
        return self.answers.get(call.stage, call.stage)

    def stages(self) -> list[str]:
        return [stage for stage, *_ in self.log]

    def span(self, stage: str) -> tuple[float, float]:
        return next((start, end) for name, start, end, _ in self.log if name == stage)


async def three_stages(value, call):
    first = await call("a", {"X": value}, ["Y"])
    second, third = await gather(call("b", {"X": first}, ["Y"]), call("c", {"X": first}, ["Y"]))
    return [first, second, third]


def test_each_step_goes_to_send_in_order_with_what_the_run_function_asked():
    seen = []

    def send(call):
        seen.append((call.stage, call.inputs, call.outputs, call.reduce))
        return {"a": 2, "b": 3, "c": 4}[call.stage]

    assert drive.drive(three_stages(1, Call), send) == [2, 3, 4]
    assert seen == [("a", {"X": 1}, ["Y"], None), ("b", {"X": 2}, ["Y"], None),
                    ("c", {"X": 2}, ["Y"], None)]


def test_a_bare_call_or_gather_is_driven_as_a_run_function():
    assert drive.drive(Call("a", {}, ["Y"]), lambda call: call.stage) == "a"
    assert drive.drive(gather(Call("a", {}, []), Call("b", {}, [])), lambda c: c.stage) == ["a", "b"]


def test_gathered_branches_run_together_on_the_pool(pools):
    pools.append(workers := pool(4))
    send = Recorder({"a": 0.05, "b": 0.3, "c": 0.3})
    started = time.monotonic()
    assert drive.drive(three_stages(0, Call), send, workers) == ["a", "b", "c"]
    assert time.monotonic() - started < 0.5  # a, then b and c together: not 0.65 s
    (b_start, b_end), (c_start, c_end) = send.span("b"), send.span("c")
    assert b_start >= send.span("a")[1] and c_start >= send.span("a")[1]
    assert b_start < c_end and c_start < b_end, "the branches did not overlap"
    threads = {stage: thread for stage, _, _, thread in send.log}
    assert threads["a"] == threads["b"] == threading.current_thread().name, \
        "the first branch runs on the calling thread"
    assert threads["c"].startswith("test-")


@pytest.mark.parametrize("size", [0, None], ids=["a-full-pool", "no-pool"])
def test_branches_no_thread_takes_run_inline_one_after_the_other(pools, size):
    workers = None
    if size is not None:
        pools.append(workers := pool(size))
    send = Recorder({"b": 0.1, "c": 0.1})
    assert drive.drive(three_stages(0, Call), send, workers) == ["a", "b", "c"]
    assert {thread for *_, thread in send.log} == {threading.current_thread().name}
    assert send.span("c")[0] >= send.span("b")[1]


def test_a_pool_with_fewer_threads_than_branches_runs_the_rest_inline(pools):
    """Three branches and one free thread: the second goes to the pool, the first and the third
    run here, and nothing waits for a thread."""
    pools.append(workers := pool(1))

    async def fan_out(call):
        return await gather(call("x", {}, []), call("y", {}, []), call("z", {}, []))

    send = Recorder({"x": 0.2, "y": 0.2, "z": 0.2})
    started = time.monotonic()
    assert drive.drive(fan_out(Call), send, workers) == ["x", "y", "z"]
    assert time.monotonic() - started < 0.55  # x then z here, y beside them: not 0.6 s
    here = threading.current_thread().name
    threads = {stage: thread for stage, _, _, thread in send.log}
    assert threads["x"] == threads["z"] == here and threads["y"] != here


def test_a_failed_branch_waits_for_its_sibling_then_the_pipeline_error_wins(pools):
    pools.append(workers := pool(2))
    failure = PipelineError(Code.INVALID_ARG, "bad row")
    send = Recorder({"c": 0.2}, fail={"b": ValueError("a bug"), "c": failure})
    with pytest.raises(PipelineError) as raised:
        drive.drive(three_stages(0, Call), send, workers)
    assert raised.value is failure
    assert sorted(send.stages()) == ["a", "b", "c"], "a branch was left running"


def test_a_failed_branch_raises_its_own_error_when_no_pipeline_error_came(pools):
    pools.append(workers := pool(2))
    send = Recorder({"b": 0.1}, fail={"c": ValueError("a bug")})
    with pytest.raises(ValueError, match="a bug"):
        drive.drive(three_stages(0, Call), send, workers)
    assert sorted(send.stages()) == ["a", "b", "c"]


def test_abandoned_in_one_branch_wins_over_the_others_failures(pools):
    pools.append(workers := pool(2))
    send = Recorder({"b": 0.1}, fail={"b": PipelineError(Code.INTERNAL, "x"), "c": Abandoned()})
    with pytest.raises(Abandoned):
        drive.drive(three_stages(0, Call), send, workers)


def test_the_run_function_can_catch_a_sub_requests_error():
    async def tolerant(call):
        try:
            await call("a", {}, ["Y"])
        except PipelineError as error:
            return f"fallback: {error.code.value}"

    def busy(call):
        raise PipelineError(Code.UNAVAILABLE, "busy")

    assert drive.drive(tolerant(Call), busy) == "fallback: UNAVAILABLE"


def test_the_run_functions_failure_is_raised():
    def refuse(call):
        raise PipelineError(Code.INVALID_ARG, f"no {call.stage}")

    with pytest.raises(PipelineError, match="no a"):
        drive.drive(three_stages(0, Call), refuse)


def test_awaiting_anything_else_is_a_type_error_thrown_into_the_run_function():
    async def sleeps(call):
        await asyncio.sleep(0)

    with pytest.raises(TypeError, match=r"may await only call\(...\) and gather_all\(...\)"):
        drive.drive(sleeps(Call), lambda call: None)

    async def catches(call):
        try:
            await asyncio.sleep(0)
        except TypeError:
            return await call("after", {}, [])

    assert drive.drive(catches(Call), lambda call: call.stage) == "after"


def test_abandoned_stops_the_coroutine_at_once():
    """``send`` raising ``Abandoned`` (no request wants the answer) is not an error the run
    function can catch: it stops there, its ``finally`` runs, no further sub-request."""
    closed, sent = [], []

    async def stubborn(call):
        try:
            try:
                await call("a", {}, [])
            except Exception:  # noqa: BLE001 - what a run function may well do
                pass
            return await call("b", {}, [])
        finally:
            closed.append(True)

    def abandon(call):
        sent.append(call.stage)
        raise Abandoned

    with pytest.raises(Abandoned):
        drive.drive(stubborn(Call), abandon)
    assert sent == ["a"] and closed == [True]


def test_a_run_that_ends_with_an_error_leaves_no_coroutine_suspended(pools):
    pools.append(workers := pool(2))
    closed = []

    async def branch(call, name):
        try:
            return await call(name, {}, [])
        finally:
            closed.append(name)

    async def fan_out(call):
        await gather(branch(call, "b"), branch(call, "c"))
        return await branch(call, "d")

    send = Recorder({"b": 0.05}, fail={"c": PipelineError(Code.INTERNAL, "x")})
    with pytest.raises(PipelineError):
        drive.drive(fan_out(Call), send, workers)
    assert sorted(closed) == ["b", "c"] and "d" not in send.stages()


def test_nested_gathers_and_plain_coroutines_are_driven(pools):
    async def inner(call, name):
        one = await call(name, {}, ["Y"])
        return one + 1

    async def outer(call):
        return await gather(inner(call, "a"), gather(inner(call, "b"), call("c", {}, ["Y"])))

    answers = {"a": 1, "b": 10, "c": 100}
    assert drive.drive(outer(Call), lambda call: answers[call.stage]) == [2, [11, 100]]
    pools.append(workers := pool(1))  # a nested gather on a pool thread finds none free
    assert drive.drive(outer(Call), Recorder({"a": 0.05, "b": 0.05}, answers), workers) \
        == [2, [11, 100]]


def test_a_pool_refuses_when_no_thread_is_free_and_reuses_a_thread_once_free(pools):
    pools.append(workers := pool(2))
    release, started = threading.Event(), threading.Semaphore(0)

    def hold():
        started.release()
        release.wait(5)

    assert workers.offer(hold) and workers.offer(hold)
    assert started.acquire(timeout=2) and started.acquire(timeout=2)
    assert not workers.offer(hold), "a third piece of work was taken with both threads busy"
    assert workers._work.qsize() == 0, "refused work must not wait in a queue"
    release.set()
    done = threading.Event()
    give_up = time.monotonic() + 2
    while not workers.offer(done.set):
        assert time.monotonic() < give_up, "a thread never became free again"
        time.sleep(0.01)
    assert done.wait(2)
    assert len(workers._threads) == 2, "a free thread was not reused"


def test_a_pool_refuses_after_shutdown_and_reports_a_thread_still_stuck():
    workers = pool(2)
    release = threading.Event()
    assert workers.offer(release.wait, 5)
    time.sleep(0.05)
    assert workers.shutdown(0.1) == 1, "the stuck thread was not reported"
    assert not workers.offer(print)
    release.set()
    for thread in workers._threads:
        thread.join(2)
    assert not any(thread.is_alive() for thread in workers._threads)
    assert all(thread.daemon for thread in workers._threads), \
        "a thread stuck in a sub-model must not keep the stub process alive"


def test_work_that_raises_is_logged_and_the_thread_serves_on(pools):
    log: list[str] = []
    pools.append(workers := pool(1, log))
    done = threading.Event()

    def bug():
        raise ZeroDivisionError("a bug")

    assert workers.offer(bug)
    give_up = time.monotonic() + 2
    while not workers.offer(done.set):
        assert time.monotonic() < give_up
        time.sleep(0.01)
    assert done.wait(2) and any("ZeroDivisionError" in line for line in log)
