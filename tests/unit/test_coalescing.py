"""The coalescer alone (bls_models/coalescing.py), over a fake ``send``: grouping while busy,
splitting by rows, each member's own deadline, isolation of a failed group."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from bls_models.coalescing import Coalescer


@dataclass
class Outcome:
    outputs: dict | None = None
    error: str | None = None
    expired: bool = False


class FakeStage:
    """A sub-model that doubles its input, takes ``delay`` per sub-request and fails the whole
    batch when a row holds ``POISON``, like ONNX Runtime running a batch as one call."""

    POISON = -1.0

    def __init__(self, delay: float = 0.05) -> None:
        self.delay, self.batches = delay, []

    async def send(self, inputs, output_names, reduce, limit, request_id):
        x = inputs["X"]
        self.batches.append((len(x), request_id))
        await asyncio.sleep(min(self.delay, max(limit, 0)))
        if self.delay > limit:
            return None, True
        if (x == self.POISON).any():
            return Outcome(error=f"batch of {len(x)} poisoned"), False
        return Outcome(outputs={"Y": x * 2}), False


def member_input(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"X": np.full((rows, 3), value, np.float32)}


async def burst(coalescer, values, limit=5.0, rows=1):
    return await asyncio.gather(*(coalescer.submit(member_input(v, rows), ("Y",), None, limit,
                                                   f"r{v}") for v in values))


async def behind_a_blocker(coalescer, then, pause: float = 0.005):
    """Send one member, wait ``pause`` (it is then in flight), run ``then()``; its result and
    the blocker's."""
    blocker = asyncio.ensure_future(coalescer.submit(member_input(9), ("Y",), None, 5, "b"))
    await asyncio.sleep(pause)
    result = await then()
    return result, await blocker


def test_alone_it_is_sent_at_once_and_while_busy_arrivals_go_as_one_group():
    stage = FakeStage(delay=0.05)

    async def scenario():
        coalescer = Coalescer(16, 1, stage.send, Outcome)
        first = asyncio.ensure_future(coalescer.submit(member_input(0), ("Y",), None, 5, "a"))
        await asyncio.sleep(0.01)  # the first is in flight: the next five wait for it
        rest = await burst(coalescer, [1, 2, 3, 4, 5])
        return await first, rest, coalescer.stats

    first, rest, stats = asyncio.run(scenario())
    assert stats.sizes == [1, 5] and [b for b, _ in stage.batches] == [1, 5]
    np.testing.assert_array_equal(first[0].outputs["Y"], np.zeros((1, 3)))
    for value, (outcome, timed_out) in zip([1, 2, 3, 4, 5], rest):
        assert not timed_out
        np.testing.assert_array_equal(outcome.outputs["Y"], np.full((1, 3), value * 2))


def test_a_group_never_exceeds_the_stage_models_max_batch_size():
    stage = FakeStage(delay=0.02)

    async def scenario():
        coalescer = Coalescer(4, 1, stage.send, Outcome)
        # 12 rows: groups of at most 4 rows
        results, _ = await behind_a_blocker(coalescer, lambda: burst(coalescer, range(6), rows=2))
        return results

    results = asyncio.run(scenario())
    assert all(rows <= 4 for rows, _ in stage.batches)
    for value, (outcome, _) in zip(range(6), results):
        assert outcome.outputs["Y"].shape == (2, 3)
        assert (outcome.outputs["Y"] == value * 2).all()


def test_a_member_whose_deadline_passes_is_let_go_while_its_group_goes_on():
    stage = FakeStage(delay=0.2)

    async def scenario():
        coalescer = Coalescer(16, 1, stage.send, Outcome)
        await burst(coalescer, [3])  # 200 ms is the stage's usual: the blocker is no straggler

        async def short_and_long():
            long = asyncio.ensure_future(coalescer.submit(member_input(2), ("Y",), None, 5.0,
                                                          "long"))
            started = time.monotonic()
            short = await coalescer.submit(member_input(1), ("Y",), None, 0.1, "short")
            return short, time.monotonic() - started, await long

        return (await behind_a_blocker(coalescer, short_and_long, pause=0.01))[0]

    (short, short_timed_out), elapsed, (long, _) = asyncio.run(scenario())
    assert short is None and short_timed_out and elapsed < 0.1 + 0.25  # support.SLACK
    assert (long.outputs["Y"] == 4).all()
    # The short member expired in the queue: it was never sent.
    assert not any("short" in ids for _, ids in stage.batches)


def test_a_failed_group_is_resent_member_by_member_so_only_the_culprit_fails():
    stage = FakeStage(delay=0.02)

    async def scenario():
        coalescer = Coalescer(16, 1, stage.send, Outcome)
        results, _ = await behind_a_blocker(coalescer,
                                            lambda: burst(coalescer, [1, FakeStage.POISON, 3]))
        return results, coalescer.stats

    results, stats = asyncio.run(scenario())
    assert stats.isolated == 1 and stats.sizes == [1, 3]
    assert [rows for rows, _ in stage.batches] == [1, 3, 1, 1, 1]
    (good1, _), (bad, _), (good3, _) = results
    assert bad.error and "poisoned" in bad.error and bad.outputs is None
    assert (good1.outputs["Y"] == 2).all() and (good3.outputs["Y"] == 6).all()


def test_every_member_gets_exactly_its_own_rows_under_a_burst():
    stage = FakeStage(delay=0.005)
    values = list(range(500))

    async def scenario():
        coalescer = Coalescer(16, 2, stage.send, Outcome)
        return await burst(coalescer, values), coalescer.stats

    results, stats = asyncio.run(scenario())
    for value, (outcome, timed_out) in zip(values, results):
        assert not timed_out and (outcome.outputs["Y"] == value * 2).all()
    assert sum(stats.sizes) == 500 and max(stats.sizes) <= 16
    assert len(stats.sizes) < 500 / 4  # grouped, not one by one


def test_a_lone_member_that_failed_is_resent_once_and_a_stage_error_is_not():
    """The sub-model's batcher may have put a lone member with another request's bad item: it is
    re-sent alone once. An error about the stage (here: queue full) is not re-sent."""
    calls = []

    async def flaky(inputs, output_names, reduce, limit, request_id):
        calls.append(request_id)
        if request_id == "unlucky" and calls.count("unlucky") == 1:
            return Outcome(error="onnx runtime error 2: batch had a bad index"), False
        if request_id == "full":
            return Outcome(error="Exceeds maximum queue size"), False
        return Outcome(outputs={"Y": inputs["X"]}), False

    async def scenario():
        coalescer = Coalescer(16, 1, flaky, Outcome,
                              isolate=lambda error: "queue size" not in error)
        unlucky = await coalescer.submit(member_input(1), ("Y",), None, 5, "unlucky")
        full = await coalescer.submit(member_input(2), ("Y",), None, 5, "full")
        return unlucky, full

    (unlucky, _), (full, _) = asyncio.run(scenario())
    assert unlucky.error is None and calls.count("unlucky") == 2
    assert full.error and calls.count("full") == 1


def test_isolation_resends_one_at_a_time_so_the_sub_models_batcher_cannot_regroup_them():
    in_flight, peak = 0, 0
    stage = FakeStage(delay=0.01)

    async def counting(*args):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await stage.send(*args)
        finally:
            in_flight -= 1

    async def scenario():
        coalescer = Coalescer(16, 1, counting, Outcome)
        return (await behind_a_blocker(
            coalescer, lambda: burst(coalescer, [1, 2, FakeStage.POISON, 4]), pause=0.002))[0]

    results = asyncio.run(scenario())
    assert peak == 1
    assert [bool(outcome.error) for outcome, _ in results] == [False, False, True, False]


class BatchingStage:
    """A sub-model with its own dynamic batcher: sub-requests that arrive within ``window`` run
    as one batch, which fails for all of them if any row is poisoned (Triton's batcher in front
    of ONNX Runtime)."""

    def __init__(self, window: float = 0.02) -> None:
        self.window, self.waiting, self.batches = window, [], []

    async def send(self, inputs, output_names, reduce, limit, request_id):
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((inputs["X"], future))
        if len(self.waiting) == 1:
            asyncio.get_running_loop().call_later(self.window, self._run)
        return await future, False

    def _run(self):
        batch, self.waiting = self.waiting, []
        self.batches.append(sum(len(x) for x, _ in batch))
        poisoned = any((x == FakeStage.POISON).any() for x, _ in batch)
        for x, future in batch:
            future.set_result(Outcome(error="onnx runtime error 2: out of bounds") if poisoned
                              else Outcome(outputs={"Y": x * 2}))


def test_isolation_has_the_stage_to_itself_so_the_sub_models_batcher_cannot_mix_re_sends():
    """Two sub-requests out at once (a group with the culprit, and a lone innocent one) land in
    one batch of the sub-model and both fail. Their isolations run one after the other, with
    nothing else of the stage out: every innocent member succeeds."""
    stage = BatchingStage()

    async def scenario():
        coalescer = Coalescer(16, 2, stage.send, Outcome)
        first = asyncio.ensure_future(coalescer.submit(member_input(FakeStage.POISON), ("Y",),
                                                       None, 5, "culprit"))
        await asyncio.sleep(0.002)  # the culprit is out alone; the group takes the second slot
        group = asyncio.ensure_future(burst(coalescer, [2, 3, 4]))
        return await first, await group, coalescer.stats

    (culprit, _), group, stats = asyncio.run(scenario())
    assert stats.sizes == [1, 3] and stats.isolated == 2
    assert culprit.error is not None
    for value, (outcome, _) in zip([2, 3, 4], group):
        assert outcome.error is None and (outcome.outputs["Y"] == value * 2).all()
    assert stage.batches[0] == 4  # the first batch mixed both sub-requests


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
            coalescer = Coalescer(16, 1, stage.send, Outcome, exclusive=exclusive)
            results, _ = await behind_a_blocker(
                coalescer, lambda: burst(coalescer, [1, FakeStage.POISON, 3], limit=2.0))
            return results

        started = time.monotonic()
        results = asyncio.run(scenario())
        # Asked once, with the latest limit of the failed group's members.
        assert len(asked) == 1 and started + 1.5 < asked[0] < started + 2.5 + 0.25
        assert inside == [grant, "released"]
        if grant:
            assert [rows for rows, _ in stage.batches] == [1, 3, 1, 1, 1]
            assert [r.error is not None for r, _ in results] == [False, True, False]
        else:
            assert [rows for rows, _ in stage.batches] == [1, 3]
            assert all(r.expired for r, _ in results)


def test_a_straggler_gives_its_slot_back_so_members_behind_it_are_not_held_up():
    """One sub-request stuck 1 s in a slow sub-model holds the stage's only slot; once it is out
    3x the stage's median duration, the members queued behind it go as the next group."""

    class SlowForOne(FakeStage):
        async def send(self, inputs, output_names, reduce, limit, request_id):
            if request_id == "slow":
                self.batches.append((len(inputs["X"]), request_id))
                await asyncio.sleep(1.0)
                return Outcome(outputs={"Y": inputs["X"] * 2}), False
            return await super().send(inputs, output_names, reduce, limit, request_id)

    stage = SlowForOne(delay=0.01)

    async def scenario():
        coalescer = Coalescer(16, 1, stage.send, Outcome)
        await burst(coalescer, [1, 2])  # the stage's usual duration: 10 ms
        slow = asyncio.ensure_future(coalescer.submit(member_input(5), ("Y",), None, 5, "slow"))
        await asyncio.sleep(0.005)
        started = time.monotonic()
        results = await burst(coalescer, [6, 7, 8])
        behind = time.monotonic() - started
        return results, behind, await slow

    results, behind, (slow, _) = asyncio.run(scenario())
    assert all((r.outputs["Y"] == 2 * v).all() for (r, _), v in zip(results, [6, 7, 8]))
    assert (slow.outputs["Y"] == 10).all()
    # Not 1 s: the slot came back after 3 x 10 ms (support.SLACK for a busy host).
    assert behind < 0.03 + 0.01 + 0.25, behind
