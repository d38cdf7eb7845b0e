"""Coalescing: one sub-request per stage for the requests that reach it together.

A stage's ``Coalescer`` sends a member (one request's ``Part`` of a sub-request) as soon as the
event loop's current turn ends, while fewer than ``max_in_flight`` sub-requests to the stage are
out: at concurrency 1 nothing waits for company. Members that arrive in the same turn (e.g. the
rows of one group coming back from the previous stage) go together; members that arrive while
the stage is busy queue, and the next free slot takes them all as one group (batch-while-busy, no
timer), up to the stage model's ``max_batch_size`` rows. Only members whose inputs have the same
names, trailing shapes and dtypes, and which ask for the same outputs, go together.

``send(parts, output_names)`` (the runtime's ``SubRequests.send``) sends a group and answers one
``Outcome`` per part: it concatenates the parts still within their limits when a thread actually
sends, splits the outputs back by rows, and applies each part's own ``reduce``.

Every member keeps its own semantics:

* **Exactly one result, whatever raises.** A group that fails in any way settles every member at
  once: with the sub-model's error, or as an internal failure of the stage (logged) when the
  coalescer or the runtime raised.
* **Deadline.** Each member waits with its own limit; one whose limit passes is let go (its
  caller answers the deadline error) while its group goes on. A member whose limit passed before
  its group is sent is never sent.
* **Isolation.** A sub-request that fails with an error one bad item can cause (``Kind.INVALID``:
  the onnxruntime backend runs a batch as one call, so one bad item fails all) has its members
  re-sent one at a time, each within its own limit: the culprit gets its own error, the others
  their results. This covers the sub-model's own dynamic batcher too, which may have put a lone
  member with another request's bad item: a failed group of one is re-sent once. Re-sends are
  paid from an ``IsolationBudget``, so a stage that rejects every request is not sent every
  request twice.
* **No head-of-line blocking.** A sub-request out for longer than ``STRAGGLER_FACTOR`` times the
  stage's median duration (of its last ``DURATIONS`` sub-requests) gives its slot back: a
  request stuck in a slow sub-model does not hold up the members queued behind it.

Nothing here grows with traffic: queues exist only while they hold members, durations are a
bounded window. Pure asyncio and numpy (``send`` is passed in), unit-tested without Triton
(tests/unit/test_coalescing.py). Runs on the runtime's event loop.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import AsyncContextManager, Awaitable, Callable

# A sub-request out this many times the stage's median duration is a straggler: its slot goes
# to the next group. Before any duration is known, FIRST_STRAGGLER_SECONDS.
STRAGGLER_FACTOR = 3.0
STRAGGLER_MIN_SECONDS = 0.005
FIRST_STRAGGLER_SECONDS = 0.1
DURATIONS = 32
# Isolation re-sends a stage may make: one per ISOLATION_EARNED_PER_SUCCESS^-1 members answered
# from a group that succeeded, at most ISOLATION_BUDGET_GROUPS full groups' worth in reserve.
ISOLATION_EARNED_PER_SUCCESS = 0.5
ISOLATION_BUDGET_GROUPS = 1


@dataclass(eq=False)
class Part:
    """One request's share of a sub-request: its inputs (rows along the first axis), when its
    limit ends (``time.monotonic``), its request id and how its outputs are reduced."""

    inputs: dict[str, object]
    rows: int
    expires: float
    request_id: str = ""
    reduce: Callable | None = None


@dataclass
class Outcome:
    """A part's result: ``outputs``, or ``error`` (the sub-model's message: classified), or
    ``internal`` (the orchestrator's own failure in the stage: logged, never classified), or
    ``expired`` (its limit passed before it was sent, or while it was out)."""

    outputs: dict | None = None
    error: str | None = None
    internal: bool = False
    expired: bool = False


EXPIRED = Outcome(expired=True)
INTERNAL = Outcome(internal=True)

# send(parts, output_names, isolating=False) -> (one Outcome per part, timed_out): ``timed_out``
# when the wait for the sub-request gave up at the latest part's limit (every part is then
# expired). ``isolating``: an isolation's re-send, made with the stage to itself (and, across
# instances, its ``exclusive`` lock held).
Send = Callable[..., Awaitable[tuple[list[Outcome], bool]]]


@dataclass(eq=False)
class Member:
    part: Part
    future: asyncio.Future


class IsolationBudget:
    """Re-sends a stage's isolations may make. Earned by members answered from a group that
    succeeded (a stage that fails every request earns nothing), kept up to ``capacity``; an
    isolation of ``n`` members spends ``n`` or does not happen (its members then get the group's
    error). So a stage's isolation re-sends never exceed ``capacity`` plus
    ``ISOLATION_EARNED_PER_SUCCESS`` times its successful members."""

    def __init__(self, capacity: float) -> None:
        self.capacity = self.tokens = float(capacity)

    def earn(self, members: int) -> None:
        self.tokens = min(self.capacity, self.tokens + ISOLATION_EARNED_PER_SUCCESS * members)

    def spend(self, members: int) -> bool:
        if members > self.tokens:
            return False
        self.tokens -= members
        return True


class Coalescer:
    def __init__(self, max_rows: int, max_in_flight: int, send: Send,
                 on_group: Callable[[int], None] | None = None,
                 isolate: Callable[[str], bool] = lambda error: False,
                 exclusive: Callable[[float], AsyncContextManager[bool]] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.max_rows, self.max_in_flight, self.send = max_rows, max(1, max_in_flight), send
        self.on_group = on_group or (lambda size: None)
        # Whether a failed sub-request's error may come from one bad item of its batch (then
        # its members are re-sent alone) rather than from the stage as a whole.
        self.isolate = isolate
        self.budget = IsolationBudget(ISOLATION_BUDGET_GROUPS * max_rows)
        # exclusive(expires): the stage to this process across the orchestrator's instances
        # (stagelock.StageLock.exclusive), yielding False if ``expires`` passed first.
        self.exclusive_across = exclusive
        self.log = log or (lambda message: None)
        self.queues: dict[tuple, deque[Member]] = {}  # only keys that hold members
        self.in_flight = 0  # sub-requests holding a slot
        self.out = 0        # sub-requests out, stragglers that gave their slot back included
        self.durations: deque[float] = deque(maxlen=DURATIONS)
        # Isolation has the stage to itself: re-sends wait until nothing else of this stage is
        # out and no other isolation runs, and nothing new goes out until they are done (see
        # _isolate_alone). One mechanism: counters the event loop alone changes, and an event
        # set whenever one of them falls.
        self.isolations = 0          # failed sub-requests waiting for, or in, isolation
        self.isolating = False       # one of them has the stage
        self.quiet = asyncio.Event()
        self.pump_scheduled = False
        self.tasks: set[asyncio.Task] = set()

    async def submit(self, part: Part, output_names) -> Outcome:
        """This part's outcome, as ``send`` would give it for the part alone."""
        loop = asyncio.get_running_loop()
        member = Member(part, loop.create_future())
        self.queues.setdefault(_key(part, output_names), deque()).append(member)
        if not self.pump_scheduled:
            # At the end of this loop turn, not now: members resumed in the same turn (the rows
            # of one group coming back from the previous stage) go on together.
            self.pump_scheduled = True
            loop.call_soon(self._pump)
        done, _ = await asyncio.wait({member.future},
                                     timeout=max(0.0, part.expires - time.monotonic()))
        if done:
            return member.future.result()
        member.future.cancel()  # its group (if any) goes on without it
        return EXPIRED

    # -- groups --------------------------------------------------------------------------------
    def _pump(self) -> None:
        self.pump_scheduled = False
        while self.in_flight < self.max_in_flight and not self.isolations:
            picked = self._next_group()
            if picked is None:
                return
            key, members = picked
            self.in_flight += 1
            task = asyncio.ensure_future(self._run(list(key[1]), members))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _next_group(self) -> tuple[tuple, list[Member]] | None:
        now = time.monotonic()
        for key, queue in list(self.queues.items()):
            members, rows = [], 0
            while queue:
                member = queue[0]
                if member.future.done() or member.part.expires <= now:  # gone, or never sent
                    queue.popleft()
                    _settle(member, EXPIRED)
                    continue
                if members and rows + member.part.rows > self.max_rows:
                    break
                members.append(queue.popleft())
                rows += member.part.rows
            if not queue:
                del self.queues[key]
            if members:
                return key, members
        return None

    async def _run(self, output_names: list[str], members: list[Member]) -> None:
        holding = [True]  # this task's slot in in_flight (isolation gives it back while waiting)
        try:
            self.on_group(sum(member.part.rows for member in members))
            started = time.monotonic()
            straggler = asyncio.get_running_loop().call_later(
                self._straggler_after(), self._give_back, holding)
            self.out += 1
            try:
                outcomes, timed_out = await self.send([m.part for m in members], output_names)
            finally:
                self.out -= 1
                straggler.cancel()
            if not timed_out:
                self.durations.append(time.monotonic() - started)
            results = list(zip(members, outcomes, strict=True))
            failed = [(m, o) for m, o in results if o.error is not None]
            if failed and self.isolate(failed[0][1].error) and self.budget.spend(len(failed)):
                for member, outcome in results:
                    if outcome.error is None:
                        _settle(member, outcome)  # expired before it was sent
                await self._isolate_alone([m for m, _ in failed], output_names, holding)
                return
            succeeded = 0
            for member, outcome in results:
                succeeded += outcome.outputs is not None
                _settle(member, outcome)
            self.budget.earn(succeeded)
        except asyncio.CancelledError:
            _settle_all(members, INTERNAL)
            raise
        except BaseException:  # noqa: BLE001 - every member is answered; the cause is logged
            self.log(f"coalesced sub-request failed:\n{traceback.format_exc()}")
            _settle_all(members, INTERNAL)
        finally:
            if holding[0]:
                self.in_flight -= 1
            self.quiet.set()
            self._pump()

    def _straggler_after(self) -> float:
        if not self.durations:
            return FIRST_STRAGGLER_SECONDS
        ordered = sorted(self.durations)
        return max(STRAGGLER_MIN_SECONDS, STRAGGLER_FACTOR * ordered[len(ordered) // 2])

    def _give_back(self, holding: list[bool]) -> None:
        """A straggler's timer: its slot goes to the next group (it stays counted in ``out``)."""
        if holding[0]:
            holding[0] = False
            self.in_flight -= 1
            self._pump()

    async def _isolate_alone(self, members: list[Member], output_names: list[str],
                             holding: list[bool]) -> None:
        """``_isolate`` with the stage to itself. A re-sent member must not meet another
        sub-request in the sub-model's batch (the culprit's, re-sent by another isolation, or a
        group sent meanwhile), so: stop sending new groups, give back this task's slot, take
        the stage's isolation lock, wait until nothing of this stage is out, then re-send."""
        self.isolations += 1
        if holding[0]:  # (a straggler gave it back already)
            self.in_flight -= 1
            holding[0] = False
        self.quiet.set()
        took = False
        try:
            # No await between the check and taking the stage: the event loop runs nothing else.
            while self.in_flight > 0 or self.out > 0 or self.isolating:
                self.quiet.clear()
                await self.quiet.wait()
            self.isolating = took = True
            self.in_flight += 1
            holding[0] = True
            if self.exclusive_across is None:
                await self._isolate(members, output_names)
                return
            async with self.exclusive_across(max(m.part.expires for m in members)) as held:
                if held:
                    await self._isolate(members, output_names)
                else:  # the other instances' sub-requests outlasted every member's limit
                    _settle_all(members, EXPIRED)
        finally:
            self.isolations -= 1
            if took:
                self.isolating = False
                self.quiet.set()

    async def _isolate(self, members: list[Member], output_names: list[str]) -> None:
        """Re-send the members of a failed sub-request one by one, each within its own limit:
        the culprit gets its own error, the others their results. One at a time, because the
        sub-model's own dynamic batcher would put concurrent ones back into one batch with the
        culprit. Called with the stage to itself."""
        for member in members:
            if member.future.done():
                continue
            if member.part.expires <= time.monotonic():
                _settle(member, EXPIRED)
                continue
            outcomes, _ = await self.send([member.part], output_names, isolating=True)
            _settle(member, outcomes[0])

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _key(part: Part, output_names) -> tuple:
    """Members go together only if their inputs concatenate: the same names, trailing shapes
    and dtypes, in the same order, and they ask for the same outputs."""
    return (tuple((name, getattr(value, "shape", ())[1:], str(getattr(value, "dtype", "")))
                  for name, value in part.inputs.items()), tuple(output_names))


def _settle(member: Member, outcome: Outcome) -> None:
    if not member.future.done():
        member.future.set_result(outcome)


def _settle_all(members: list[Member], outcome: Outcome) -> None:
    for member in members:
        _settle(member, outcome)

