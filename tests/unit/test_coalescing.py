"""The coalescer alone (bls_models/coalescing.py), over a fake ``send``: grouping while busy,
splitting by rows, each member's own deadline, isolation of a failed group and its budget,
every member settled whatever raises, nothing that grows with traffic."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque

import numpy as np
import pytest

from bls_models.coalescing import EXPIRED, Coalescer, IsolationBudget, Outcome, Part
from bls_models.errors import Kind, classify_sub_error

SLACK = 0.25  # tests/live/support.SLACK: what a busy 2-core host may add to a promise about time


def item_caused(error: str) -> bool:  # what the runtime passes (subrequests._item_caused)
    return classify_sub_error(error) is Kind.INVALID


class FakeStage:
    """A sub-model that doubles its input, takes ``delay`` per sub-request and fails the whole
    batch when a row holds ``POISON``, like ONNX Runtime running a batch as one call. It sends
    only the parts still within their limits, as the runtime's ``send`` does."""

    POISON = -1.0
    ERROR = "onnx runtime error 2: Non-zero status code: indices element out of data bounds"

    def __init__(self, delay: float = 0.05) -> None:
        self.delay, self.batches = delay, []

    async def send(self, parts, output_names, isolating=False):
        now = time.monotonic()
        live = [p for p in parts if p.expires > now]
        if not live:
            return [EXPIRED] * len(parts), False
        x = np.concatenate([p.inputs["X"] for p in live])
        self.batches.append((len(x), ",".join(p.request_id for p in live)))
        limit = max(p.expires for p in parts) - now
        await asyncio.sleep(min(self.delay, max(limit, 0)))
        if self.delay > limit:
            return [EXPIRED] * len(parts), True
        outcomes, start = [], 0
        for part in parts:
            if part not in live:
                outcomes.append(EXPIRED)
            elif (x == self.POISON).any():
                outcomes.append(Outcome(error=self.ERROR))
            else:
                rows = x[start:start + part.rows] * 2
                start += part.rows
                outputs = {"Y": rows}
                outcomes.append(Outcome(outputs=part.reduce(outputs) if part.reduce else outputs))
        return outcomes, False


def part(value: float, rows: int = 1, limit: float = 5.0, request_id: str = "",
         reduce=None) -> Part:
    return Part({"X": np.full((rows, 3), value, np.float32)}, rows, time.monotonic() + limit,
                request_id or f"r{value}", reduce)


async def burst(coalescer, values, limit=5.0, rows=1):
    return await asyncio.gather(*(coalescer.submit(part(v, rows, limit), ("Y",)) for v in values))


async def behind_a_blocker(coalescer, then, pause: float = 0.005):
    """Send one member, wait ``pause`` (it is then in flight), run ``then()``; its result and
    the blocker's."""
    blocker = asyncio.ensure_future(coalescer.submit(part(9, request_id="b"), ("Y",)))
    await asyncio.sleep(pause)
    result = await then()
    return result, await blocker


def coalescer_of(stage_send, max_rows=16, in_flight=1, sizes=None, **kwargs) -> Coalescer:
    return Coalescer(max_rows, in_flight, stage_send,
                     on_group=sizes.append if sizes is not None else None,
                     isolate=kwargs.pop("isolate", item_caused), **kwargs)


def test_alone_it_is_sent_at_once_and_while_busy_arrivals_go_as_one_group():
    stage, sizes = FakeStage(delay=0.05), []

    async def scenario():
        coalescer = coalescer_of(stage.send, sizes=sizes)
        first = asyncio.ensure_future(coalescer.submit(part(0), ("Y",)))
        await asyncio.sleep(0.01)  # the first is in flight: the next five wait for it
        rest = await burst(coalescer, [1, 2, 3, 4, 5])
        return await first, rest

    first, rest = asyncio.run(scenario())
    assert sizes == [1, 5] and [b for b, _ in stage.batches] == [1, 5]
    np.testing.assert_array_equal(first.outputs["Y"], np.zeros((1, 3)))
    for value, outcome in zip([1, 2, 3, 4, 5], rest):
        np.testing.assert_array_equal(outcome.outputs["Y"], np.full((1, 3), value * 2))


def test_a_group_never_exceeds_the_stage_models_max_batch_size():
    stage = FakeStage(delay=0.02)

    async def scenario():
        coalescer = coalescer_of(stage.send, max_rows=4)
        # 12 rows: groups of at most 4 rows
        results, _ = await behind_a_blocker(coalescer, lambda: burst(coalescer, range(6), rows=2))
        return results

    results = asyncio.run(scenario())
    assert all(rows <= 4 for rows, _ in stage.batches)
    for value, outcome in zip(range(6), results):
        assert outcome.outputs["Y"].shape == (2, 3)
        assert (outcome.outputs["Y"] == value * 2).all()


def test_a_member_whose_deadline_passes_is_let_go_while_its_group_goes_on():
    stage = FakeStage(delay=0.2)

    async def scenario():
        coalescer = coalescer_of(stage.send)
        await burst(coalescer, [3])  # 200 ms is the stage's usual: the blocker is no straggler

        async def short_and_long():
            long = asyncio.ensure_future(coalescer.submit(part(2, request_id="long"), ("Y",)))
            started = time.monotonic()
            short = await coalescer.submit(part(1, limit=0.1, request_id="short"), ("Y",))
            return short, time.monotonic() - started, await long

        return (await behind_a_blocker(coalescer, short_and_long, pause=0.01))[0]

    short, elapsed, long = asyncio.run(scenario())
    assert short.expired and elapsed < 0.1 + SLACK
    assert (long.outputs["Y"] == 4).all()
    # The short member expired in the queue: it was never sent.
    assert not any("short" in ids for _, ids in stage.batches)


def test_a_failed_group_is_resent_member_by_member_so_only_the_culprit_fails():
    stage, sizes = FakeStage(delay=0.02), []

    async def scenario():
        coalescer = coalescer_of(stage.send, sizes=sizes)
        results, _ = await behind_a_blocker(coalescer,
                                            lambda: burst(coalescer, [1, FakeStage.POISON, 3]))
        return results

    results = asyncio.run(scenario())
    assert sizes == [1, 3]
    assert [rows for rows, _ in stage.batches] == [1, 3, 1, 1, 1]
    good1, bad, good3 = results
    assert bad.error and "onnx runtime error 2" in bad.error and bad.outputs is None
    assert (good1.outputs["Y"] == 2).all() and (good3.outputs["Y"] == 6).all()


def test_every_member_gets_exactly_its_own_rows_under_a_burst():
    stage, sizes = FakeStage(delay=0.005), []
    values = list(range(500))

    async def scenario():
        return await burst(coalescer_of(stage.send, in_flight=2, sizes=sizes), values)

    results = asyncio.run(scenario())
    for value, outcome in zip(values, results):
        assert (outcome.outputs["Y"] == value * 2).all()
    assert sum(sizes) == 500 and max(sizes) <= 16
    assert len(sizes) < 500 / 4  # grouped, not one by one


def test_a_lone_member_that_failed_is_resent_once_and_errors_about_the_stage_are_not():
    """The sub-model's batcher may have put a lone member with another request's bad item: it is
    re-sent alone once. An error about the stage (queue full) or a model that fails (out of
    memory, anything unclassified) is not re-sent: re-sending would only add load."""
    calls = []

    async def flaky(parts, output_names, isolating=False):
        (only,) = parts
        calls.append(only.request_id)
        if only.request_id == "unlucky" and calls.count("unlucky") == 1:
            return [Outcome(error="onnx runtime error 2: batch had a bad index")], False
        if only.request_id == "full":
            return [Outcome(error="Exceeds maximum queue size")], False
        if only.request_id == "oom":
            return [Outcome(error="onnx runtime error 6: Failed to allocate memory")], False
        return [Outcome(outputs={"Y": only.inputs["X"]})], False

    async def scenario():
        coalescer = coalescer_of(flaky)
        return [await coalescer.submit(part(v, request_id=rid), ("Y",))
                for v, rid in ((1, "unlucky"), (2, "full"), (3, "oom"))]

    unlucky, full, oom = asyncio.run(scenario())
    assert unlucky.error is None and calls.count("unlucky") == 2
    assert full.error and calls.count("full") == 1
    assert oom.error and calls.count("oom") == 1


def test_isolation_resends_one_at_a_time_so_the_sub_models_batcher_cannot_regroup_them():
    in_flight, peak = 0, 0
    stage = FakeStage(delay=0.01)

    async def counting(*args, **kwargs):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await stage.send(*args, **kwargs)
        finally:
            in_flight -= 1

    async def scenario():
        coalescer = coalescer_of(counting)
        return (await behind_a_blocker(
            coalescer, lambda: burst(coalescer, [1, 2, FakeStage.POISON, 4]), pause=0.002))[0]

    results = asyncio.run(scenario())
    assert peak == 1
    assert [bool(outcome.error) for outcome in results] == [False, False, True, False]


class BatchingStage:
    """A sub-model with its own dynamic batcher: sub-requests that arrive within ``window`` run
    as one batch, which fails for all of them if any row is poisoned (Triton's batcher in front
    of ONNX Runtime)."""

    def __init__(self, window: float = 0.02) -> None:
        self.window, self.waiting, self.batches = window, [], []

    async def send(self, parts, output_names, isolating=False):
        x = np.concatenate([p.inputs["X"] for p in parts])
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((x, future))
        if len(self.waiting) == 1:
            asyncio.get_running_loop().call_later(self.window, self._run)
        outcome = await future
        if outcome.error is not None:
            return [outcome] * len(parts), False
        start, results = 0, []
        for p in parts:
            results.append(Outcome(outputs={"Y": outcome.outputs["Y"][start:start + p.rows]}))
            start += p.rows
        return results, False

    def _run(self):
        batch, self.waiting = self.waiting, []
        self.batches.append(sum(len(x) for x, _ in batch))
        poisoned = any((x == FakeStage.POISON).any() for x, _ in batch)
        for x, future in batch:
            future.set_result(Outcome(error=FakeStage.ERROR) if poisoned
                              else Outcome(outputs={"Y": x * 2}))


def test_isolation_has_the_stage_to_itself_so_the_sub_models_batcher_cannot_mix_re_sends():
    """Two sub-requests out at once (a group with the culprit, and a lone innocent one) land in
    one batch of the sub-model and both fail. Their isolations run one after the other, with
    nothing else of the stage out: every innocent member succeeds."""
    stage, sizes = BatchingStage(), []

    async def scenario():
        coalescer = coalescer_of(stage.send, in_flight=2, sizes=sizes)
        first = asyncio.ensure_future(coalescer.submit(part(FakeStage.POISON, request_id="c"),
                                                       ("Y",)))
        await asyncio.sleep(0.002)  # the culprit is out alone; the group takes the second slot
        group = asyncio.ensure_future(burst(coalescer, [2, 3, 4]))
        return await first, await group

    culprit, group = asyncio.run(scenario())
    assert sizes == [1, 3]
    assert stage.batches == [4, 1, 1, 1, 1]  # one mixed batch, then each member alone
    assert culprit.error is not None
    for value, outcome in zip([2, 3, 4], group):
        assert outcome.error is None and (outcome.outputs["Y"] == value * 2).all()


def test_isolation_holds_the_cross_instance_lock_and_gives_up_when_it_outlasts_the_members():
    """``exclusive``: the stage across the orchestrator's instances (stagelock.StageLock). The
    re-sends happen inside it; when another instance keeps it past every member's limit, the
    members get the deadline outcome and nothing is re-sent."""
    import contextlib

    for grant in (True, False):
        stage, inside, asked = FakeStage(delay=0.02), [], []

        @contextlib.asynccontextmanager
        async def exclusive(expires):
            asked.append(expires)
            inside.append(grant)
            yield grant
            inside.append("released")

        async def scenario():
            coalescer = coalescer_of(stage.send, exclusive=exclusive)
            results, _ = await behind_a_blocker(
                coalescer, lambda: burst(coalescer, [1, FakeStage.POISON, 3], limit=2.0))
            return results

        started = time.monotonic()
        results = asyncio.run(scenario())
        # Asked once, with the latest limit of the failed group's members.
        assert len(asked) == 1 and started + 1.5 < asked[0] < started + 2.5 + SLACK
        assert inside == [grant, "released"]
        if grant:
            assert [rows for rows, _ in stage.batches] == [1, 3, 1, 1, 1]
            assert [r.error is not None for r in results] == [False, True, False]
        else:
            assert [rows for rows, _ in stage.batches] == [1, 3]
            assert all(r.expired for r in results)


def test_a_straggler_gives_its_slot_back_so_members_behind_it_are_not_held_up():
    """One sub-request stuck 1 s in a slow sub-model holds the stage's only slot; once it is out
    3x the stage's median duration, the members queued behind it go as the next group."""

    class SlowForOne(FakeStage):
        async def send(self, parts, output_names, isolating=False):
            if parts[0].request_id == "slow":
                self.batches.append((1, "slow"))
                await asyncio.sleep(1.0)
                return [Outcome(outputs={"Y": parts[0].inputs["X"] * 2})], False
            return await super().send(parts, output_names)

    stage = SlowForOne(delay=0.01)

    async def scenario():
        coalescer = coalescer_of(stage.send)
        await burst(coalescer, [1, 2])  # the stage's usual duration: 10 ms
        slow = asyncio.ensure_future(coalescer.submit(part(5, request_id="slow"), ("Y",)))
        await asyncio.sleep(0.005)
        started = time.monotonic()
        results = await burst(coalescer, [6, 7, 8])
        behind = time.monotonic() - started
        return results, behind, await slow

    results, behind, slow = asyncio.run(scenario())
    assert all((r.outputs["Y"] == 2 * v).all() for r, v in zip(results, [6, 7, 8]))
    assert (slow.outputs["Y"] == 10).all()
    # Not 1 s: the slot came back after 3 x 10 ms.
    assert behind < 0.03 + 0.01 + SLACK, behind


# -- failure paths -------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["send", "on_group"])
def test_a_group_that_raises_settles_every_member_at_once(where):
    """Whatever raises inside a group (here ``send`` or ``on_group``), every member gets the
    stage's internal failure at once, not its deadline; the cause is logged; the slot is back."""
    logged = []

    async def broken_send(parts, output_names, isolating=False):
        raise RuntimeError("cannot schedule new futures after shutdown")

    def broken_on_group(size):
        raise ValueError("on_group failed")

    stage = FakeStage(delay=0.0)
    send = broken_send if where == "send" else stage.send

    async def scenario():
        coalescer = Coalescer(16, 1, send, on_group=broken_on_group if where == "on_group"
                              else None, isolate=item_caused, log=logged.append)
        started = time.monotonic()
        results = await burst(coalescer, [1, 2, 3], limit=10.0)
        return results, time.monotonic() - started, coalescer

    results, elapsed, coalescer = asyncio.run(scenario())
    assert all(r.internal and r.outputs is None for r in results)
    assert elapsed < SLACK, "members waited for their deadline"
    assert len(logged) >= 1 and "Error" in logged[0]
    assert coalescer.in_flight == 0 and coalescer.out == 0 and not coalescer.queues


def test_members_whose_inputs_cannot_be_concatenated_go_in_separate_groups():
    """The group key is the inputs' names, trailing shapes and dtypes: members that differ go
    as separate groups instead of failing one concatenation."""
    stage = FakeStage(delay=0.02)

    async def scenario():
        coalescer = coalescer_of(stage.send)
        odd = Part({"X": np.full((1, 5), 4, np.float32)}, 1, time.monotonic() + 5, "odd")
        wide = Part({"X": np.full((1, 3), 4, np.float64)}, 1, time.monotonic() + 5, "f64")

        async def mixed():
            return await asyncio.gather(coalescer.submit(part(1), ("Y",)),
                                        coalescer.submit(odd, ("Y",)),
                                        coalescer.submit(wide, ("Y",)),
                                        coalescer.submit(part(2), ("Y",)))
        return (await behind_a_blocker(coalescer, mixed))[0]

    results = asyncio.run(scenario())
    assert all(r.outputs is not None for r in results), results
    assert results[1].outputs["Y"].shape == (1, 5)
    assert sorted(len(ids.split(",")) for _, ids in stage.batches[1:]) == [1, 1, 2]


def test_a_stage_failing_every_request_is_not_sent_more_than_about_once_per_member():
    """A model that fails every request, with an error no item caused: never re-sent. With an
    item's kind of error (INVALID) for every request: re-sent only within the isolation budget
    (one full group in reserve, earned back only by successes)."""
    for error, resends_allowed in (("onnx runtime error 6: CUDA failure 700", 0),
                                   (FakeStage.ERROR, 16)):
        sent = []

        async def failing(parts, output_names, isolating=False):
            sent.append(len(parts))
            await asyncio.sleep(0.002)
            return [Outcome(error=error)] * len(parts), False

        async def scenario():
            coalescer = coalescer_of(failing)
            results = []
            for _ in range(20):  # 20 bursts of 8: 160 requests
                results += await burst(coalescer, range(8))
            return results

        results = asyncio.run(scenario())
        assert all(r.error == error for r in results)
        assert len(sent) == 20 + resends_allowed, (error, sent)  # 160 requests


def test_the_isolation_budget_is_earned_by_successes_and_bounded():
    budget = IsolationBudget(4)
    assert budget.spend(3) and not budget.spend(2) and budget.spend(1)
    budget.earn(3)
    assert budget.tokens == 1.5
    budget.earn(100)
    assert budget.tokens == 4  # never more than its capacity


def test_nothing_in_a_coalescer_grows_with_traffic_and_fresh_reduce_objects_still_group():
    """No per-group record, no queue per ``reduce`` object: a pipeline that passes a fresh
    ``functools.partial`` per call still coalesces, and the coalescer holds as much after 400
    groups as after 40."""
    stage, sizes = FakeStage(delay=0.002), []

    def halve(outputs, by):
        return {"Y": outputs["Y"] / by}

    def footprint(coalescer) -> int:
        return sum(len(v) for v in vars(coalescer).values()
                   if isinstance(v, (list, dict, set, deque)))

    async def scenario():
        coalescer = coalescer_of(stage.send, sizes=sizes)
        prints = []
        for rounds in (40, 360):
            for _ in range(rounds):
                results = await asyncio.gather(*(
                    coalescer.submit(part(v, reduce=functools.partial(halve, by=2)), ("Y",))
                    for v in range(4)))
                assert [float(r.outputs["Y"][0, 0]) for r in results] == [0, 1, 2, 3]
            prints.append(footprint(coalescer))
        return prints, coalescer

    (after_40, after_400), coalescer = asyncio.run(scenario())
    assert after_40 == after_400, (after_40, after_400)
    assert not coalescer.queues
    assert max(sizes) == 4, "members with different reduce objects were not grouped"
