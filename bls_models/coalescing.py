"""Coalescing: one sub-request per stage for the requests that reach it together.

A stage's ``Coalescer`` sends a member (one request's sub-request) as soon as the event loop's
current turn ends, while fewer than ``max_in_flight`` sub-requests to the stage are out: at
concurrency 1 nothing waits for company. Members that arrive in the same turn (e.g. the rows of
one group coming back from the previous stage) go together; members that arrive while the stage
is busy queue, and the next free slot takes them all as one group (batch-while-busy, no timer): their inputs concatenated along the batch axis, up to the
stage model's ``max_batch_size`` rows; the outputs split back by rows.

Every member keeps its own semantics:

* **Deadline.** Each member waits with its own limit; one whose limit passes gets ``None`` (the
  caller answers its deadline error) while its group goes on. A queued member whose limit passes
  leaves the queue and is never sent. The group's sub-request gets the latest limit of its
  members.
* **Isolation.** A sub-request that fails with an error one bad item can cause (the onnxruntime
  backend runs a batch as one call, so one bad item fails all) has its members re-sent one at a
  time, each within its own limit: the culprit gets its own error, the others their results.
  This covers the sub-model's own dynamic batcher too, which may have put a lone member with
  another request's bad item: a failed group of one is re-sent once.

* **No head-of-line blocking.** A sub-request out for longer than ``STRAGGLER_FACTOR`` times the
  stage's median duration (of its last ``DURATIONS`` sub-requests) gives its slot back: a
  request stuck in a slow sub-model does not hold up the members queued behind it.

Pure asyncio and numpy: ``send`` (the runtime's single sub-request) is passed in, so the logic is
unit-tested without Triton (tests/unit/test_coalescing.py). Runs on the runtime's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncContextManager, Awaitable, Callable

import numpy as np

# A sub-request out this many times the stage's median duration is a straggler: its slot goes
# to the next group. Before any duration is known, FIRST_STRAGGLER_SECONDS.
STRAGGLER_FACTOR = 3.0
STRAGGLER_MIN_SECONDS = 0.005
FIRST_STRAGGLER_SECONDS = 0.1
DURATIONS = 32

# send(inputs, output_names, reduce, limit_seconds, request_id) -> (outcome, timed_out): the
# runtime's one sub-request; ``outcome`` has .outputs, .error, .expired (subrequests.Outcome).
Send = Callable[..., Awaitable[tuple[object, bool]]]


@dataclass(eq=False)
class Member:
    inputs: dict[str, np.ndarray]
    rows: int
    expires: float          # monotonic time its stage limit ends
    request_id: str
    future: asyncio.Future
    queued: bool = True


@dataclass
class GroupStats:
    """What a coalescer did, for metrics and tests."""

    sizes: list[int] = field(default_factory=list)  # members per sub-request sent
    isolated: int = 0                                 # failed groups re-sent member by member


class Coalescer:
    def __init__(self, max_rows: int, max_in_flight: int, send: Send, outcome: type,
                 on_group: Callable[[int], None] | None = None,
                 isolate: Callable[[str], bool] = lambda error: True,
                 exclusive: Callable[[float], AsyncContextManager[bool]] | None = None) -> None:
        self.max_rows, self.max_in_flight, self.send = max_rows, max(1, max_in_flight), send
        self.outcome = outcome  # the type ``send`` answers with: outputs, error, expired fields
        self.on_group = on_group or (lambda size: None)
        # Whether a failed sub-request's error may come from one bad item of its batch (then
        # its members are re-sent alone) rather than from the stage as a whole (queue full, ...).
        self.isolate = isolate
        # exclusive(expires): the stage to this process across the orchestrator's instances
        # (stagelock.StageLock.exclusive), yielding False if ``expires`` passed first.
        self.exclusive_across = exclusive
        self.queues: dict[tuple, deque[Member]] = {}
        self.in_flight = 0  # sub-requests holding a slot
        self.out = 0        # sub-requests out, stragglers that gave their slot back included
        self.durations: deque[float] = deque(maxlen=DURATIONS)
        # Isolation has the stage to itself: re-sends wait until nothing else of this stage is
        # out, and nothing new goes out until they are done (see _isolate_alone).
        self.exclusive = asyncio.Lock()
        self.isolations = 0          # failed sub-requests waiting for, or in, isolation
        self.quiet = asyncio.Event()  # set whenever a sub-request of this stage comes back
        self.pump_scheduled = False
        self.tasks: set[asyncio.Task] = set()
        self.stats = GroupStats()

    async def submit(self, inputs: dict[str, np.ndarray], output_names, reduce, limit: float,
                     request_id: str) -> tuple[object, bool]:
        """This member's (outcome, timed_out), as ``send`` would give for it alone."""
        loop = asyncio.get_running_loop()
        member = Member(inputs, len(next(iter(inputs.values()))), time.monotonic() + limit,
                        request_id, loop.create_future())
        key = (tuple(inputs), tuple(output_names), reduce)
        self.queues.setdefault(key, deque()).append(member)
        if not self.pump_scheduled:
            # At the end of this loop turn, not now: members resumed in the same turn (the rows
            # of one group coming back from the previous stage) go on together.
            self.pump_scheduled = True
            loop.call_soon(self._pump)
        done, _ = await asyncio.wait({member.future}, timeout=max(0.0, limit))
        if done:
            return member.future.result()
        member.future.cancel()  # its group (if any) goes on without it
        return None, True

    # -- groups --------------------------------------------------------------------------------
    def _pump(self) -> None:
        self.pump_scheduled = False
        while self.in_flight < self.max_in_flight and not self.isolations:
            picked = self._next_group()
            if picked is None:
                return
            key, members = picked
            self.in_flight += 1
            task = asyncio.ensure_future(self._run(key, members))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _next_group(self) -> tuple[tuple, list[Member]] | None:
        now = time.monotonic()
        for key, queue in self.queues.items():
            members, rows = [], 0
            while queue:
                member = queue[0]
                if member.future.done() or member.expires <= now:  # gone, or never to be sent
                    queue.popleft().queued = False
                    _settle(member, (self.outcome(expired=True), False))
                    continue
                if members and rows + member.rows > self.max_rows:
                    break
                queue.popleft().queued = False
                members.append(member)
                rows += member.rows
            if members:
                return key, members
        return None

    async def _run(self, key: tuple, members: list[Member]) -> None:
        _, output_names, reduce = key
        holding = [True]  # this task's slot in in_flight (isolation gives it back while waiting)
        try:
            self.stats.sizes.append(len(members))
            self.on_group(len(members))
            if len(members) == 1:
                inputs, request_ids = members[0].inputs, members[0].request_id
            else:
                inputs = {name: np.concatenate([m.inputs[name] for m in members])
                          for name in members[0].inputs}
                request_ids = ",".join(m.request_id for m in members if m.request_id)
            started = time.monotonic()
            limit = max(m.expires for m in members) - started
            straggler = asyncio.get_running_loop().call_later(
                self._straggler_after(), self._give_back, holding)
            self.out += 1
            try:
                outcome, timed_out = await self.send(inputs, output_names, reduce, limit,
                                                     request_ids)
            finally:
                self.out -= 1
                straggler.cancel()
            if not timed_out:
                self.durations.append(time.monotonic() - started)
            if timed_out or outcome.expired:
                for member in members:  # each past its own limit by now (the group's is the max)
                    _settle(member, (outcome, timed_out))
            elif outcome.error is not None:
                if self.isolate(outcome.error):
                    self.stats.isolated += 1
                    await self._isolate_alone(members, output_names, reduce, holding)
                else:  # e.g. queue full: the same for each member alone
                    for member in members:
                        _settle(member, (outcome, False))
            elif len(members) == 1:
                _settle(members[0], (outcome, False))
            else:
                start = 0
                for member in members:
                    rows = slice(start, start + member.rows)
                    start += member.rows
                    _settle(member, (self.outcome(outputs={
                        name: value[rows] for name, value in outcome.outputs.items()}), False))
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

    async def _isolate_alone(self, members: list[Member], output_names, reduce,
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
        try:
            async with self.exclusive:
                while self.in_flight > 0 or self.out > 0:
                    self.quiet.clear()
                    await self.quiet.wait()
                self.in_flight += 1
                holding[0] = True
                if self.exclusive_across is None:
                    await self._isolate(members, output_names, reduce)
                    return
                async with self.exclusive_across(max(m.expires for m in members)) as held:
                    if held:
                        await self._isolate(members, output_names, reduce)
                    else:  # the other instances' sub-requests outlasted every member's limit
                        for member in members:
                            _settle(member, (self.outcome(expired=True), False))
        finally:
            self.isolations -= 1

    async def _isolate(self, members: list[Member], output_names, reduce) -> None:
        """Re-send the members of a failed sub-request one by one, each within its own limit:
        the culprit gets its own error, the others their results. One at a time, because the
        sub-model's own dynamic batcher would put concurrent ones back into one batch with the
        culprit. A group of one is re-sent once too: the sub-model's batcher may have put it
        with another request's bad item. Called with the stage to itself."""
        for member in members:
            if member.future.done():
                continue
            limit = member.expires - time.monotonic()
            if limit <= 0:
                _settle(member, (self.outcome(expired=True), False))
                continue
            _settle(member, await self.send(member.inputs, output_names, reduce, limit,
                                            member.request_id))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _settle(member: Member, result: tuple[object, bool]) -> None:
    if not member.future.done():
        member.future.set_result(result)
