"""The driver of run functions (``bls_models.flow``), with no Triton and no threads of its own:
what a flow hands out to send, in which order, and how outcomes and failures come back."""

from __future__ import annotations

import asyncio
import time

import pytest

from bls_models import flow
from bls_models.errors import Code, PipelineError
from bls_models.flow import Flow, SubRequest, gather


async def two_stages(inputs, call):
    first = await call("a", {"X": inputs}, ["Y"])
    second, third = await gather(call("b", {"X": first}, ["Y"]), call("c", {"X": first}, ["Y"]))
    return [first, second, third]


def settle(sub: SubRequest, result=None, error=None) -> SubRequest:
    sub.result, sub.error = result, error
    return sub


def test_a_flow_hands_out_each_step_and_gathered_branches_together():
    run = Flow(two_stages(1, SubRequest))
    (first,) = run.start()
    assert first.stage == "a" and first.inputs == {"X": 1} and first.outputs == ["Y"]
    branches = run.resume(settle(first, 2))
    assert [sub.stage for sub in branches] == ["b", "c"]
    assert run.resume(settle(branches[1], 4)) == []  # the gather waits for its other branch
    assert not run.done
    assert run.resume(settle(branches[0], 3)) == []
    assert run.done and run.error is None and run.result == [2, 3, 4]


def test_a_sub_request_resumed_twice_is_ignored_the_second_time():
    run = Flow(two_stages(1, SubRequest))
    (first,) = run.start()
    run.resume(settle(first, 2))
    assert run.resume(settle(first, 5)) == []  # its branch already went on


def test_a_failed_branch_waits_for_its_sibling_then_the_pipeline_error_wins():
    run = Flow(two_stages(1, SubRequest))
    (first,) = run.start()
    b, c = run.resume(settle(first, 2))
    run.resume(settle(b, error=ValueError("a bug")))
    assert not run.done, "the gather gave up before every branch ended"
    failure = PipelineError(Code.INVALID_ARG, "bad row")
    run.resume(settle(c, error=failure))
    assert run.done and run.error is failure


def test_the_run_function_can_catch_a_sub_requests_error():
    async def tolerant(call):
        try:
            await call("a", {}, ["Y"])
        except PipelineError:
            return "fallback"

    run = Flow(tolerant(SubRequest))
    (first,) = run.start()
    run.resume(settle(first, error=PipelineError(Code.UNAVAILABLE, "busy")))
    assert run.done and run.result == "fallback"


def test_awaiting_anything_else_is_a_clear_error():
    async def sleeps(call):
        await asyncio.sleep(0)

    run = Flow(sleeps(SubRequest))
    assert run.start() == []
    assert run.done and isinstance(run.error, TypeError)
    assert "may await only call(...) and gather_all(...)" in str(run.error)


def test_close_stops_every_suspended_coroutine():
    closed = []

    async def branch(call, name):
        try:
            return await call(name, {}, ["Y"])
        finally:
            closed.append(name)

    async def fan_out(call):
        return await gather(branch(call, "b"), branch(call, "c"))

    run = Flow(fan_out(SubRequest))
    assert len(run.start()) == 2
    run.close()
    assert sorted(closed) == ["b", "c"] and run.done


def test_nested_gathers_and_plain_coroutines_are_driven():
    async def inner(call, name):
        one = await call(name, {}, ["Y"])
        return one + 1

    async def outer(call):
        return await gather(inner(call, "a"), gather(inner(call, "b"), call("c", {}, ["Y"])))

    assert flow.run(outer(SubRequest), lambda sub: {"a": 1, "b": 10, "c": 100}[sub.stage]) \
        == [2, [11, 100]]


def test_run_with_threads_overlaps_gathered_branches():
    def slow(sub):
        time.sleep(0.2)
        return sub.stage

    started = time.monotonic()
    assert flow.run(two_stages(0, SubRequest), slow, threads=4) == ["a", "b", "c"]
    assert time.monotonic() - started < 0.55  # a, then b and c together: not 0.6 s


def test_run_raises_the_run_functions_failure():
    def refuse(sub):
        raise PipelineError(Code.INVALID_ARG, f"no {sub.stage}")

    with pytest.raises(PipelineError, match="no a"):
        flow.run(two_stages(0, SubRequest), refuse)
