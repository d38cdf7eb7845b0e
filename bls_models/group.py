"""A request (``Job``) and a group of them run as one: the run function once over their stacked
rows, one sub-request per stage, each member answered from its own rows.

The requests of one ``execute`` batch form groups by what they can share — input names, dtypes
and trailing shapes (``key``) — up to ``rows`` rows (the orchestrator's and every stage model's
``max_batch_size``). Requests asking for different outputs share a group: the run function
learns which rows asked for what (``Setup.rows``). A member keeps its own deadline, its own
outcome and its request id (a group's sub-requests carry its members' ids, comma-separated).
A group is ``closed`` once every member has an outcome: it then issues no further sub-request.
"""

from __future__ import annotations

import threading

import numpy as np


class Job:
    """One client request, from ``execute`` until its answer. ``outcome`` is set once, under the
    batch's lock: the outputs of its own rows, or a ``PipelineError``."""

    __slots__ = ("request", "request_id", "arrived", "end", "limit", "budget_ms", "inputs",
                 "rows", "outputs", "outcome", "answered", "sendable")

    def __init__(self, request, request_id: str, now: float, timeout_us: int,
                 default_ms: int, max_ms: int) -> None:
        self.request = request  # only while execute runs
        self.request_id, self.arrived = request_id, now
        if timeout_us <= 0:
            self.limit, budget_ms = "default deadline", default_ms
        elif timeout_us > max_ms * 1e3:
            self.limit, budget_ms = "client timeout cut to max_deadline_ms", max_ms
        else:
            self.limit, budget_ms = "client timeout", timeout_us / 1e3
        self.budget_ms = budget_ms
        self.end = now + budget_ms / 1e3  # deadlines count from arrival in execute
        self.inputs: dict[str, np.ndarray] = {}
        self.rows = 0
        self.outputs: list[str] = []
        self.outcome = None
        self.answered = False  # its response was returned or sent
        self.sendable = True  # False: the clock could not send it; execute's list answers it


class Batch:
    """One ``execute``'s requests, shared with the threads that run its groups and keep its
    time: ``lock`` over its members' outcomes and answers and its groups' sub-requests out;
    ``wake`` for a thread waiting on it (a lock used as a latch: a wake-up is never lost)."""

    __slots__ = ("lock", "_latch", "jobs", "groups", "next_check", "closing", "busy")

    def __init__(self, next_check: float) -> None:
        self.lock = threading.Lock()
        self._latch = threading.Lock()
        self._latch.acquire()
        self.jobs: list[Job] = []
        self.groups: list[Group] = []
        self.next_check = next_check  # when the clock asks its clients whether they left
        self.closing = False  # execute is answering the rest: the clock answers no more
        self.busy = 0  # the clock is answering (or asking) through its requests

    def wake(self) -> None:
        try:
            self._latch.release()
        except RuntimeError:  # woken already
            pass

    def sleep(self, seconds: float) -> None:
        """Until woken (or a wake-up came since the last sleep), at most ``seconds``."""
        self._latch.acquire(timeout=max(0.0, seconds))

    def settled(self) -> bool:
        """Every request has an outcome."""
        for job in self.jobs:
            if job.outcome is None:
                return False
        return True


def key(job: Job) -> tuple:
    """Jobs with equal keys can run as one group."""
    return tuple((name, value.dtype.str, value.shape[1:]) for name, value in job.inputs.items())


class Group:
    __slots__ = ("members", "inputs", "rows", "ids", "out", "stage", "done", "batch", "lock",
                 "started", "pad", "observed", "stage_failure")

    def __init__(self, members: list[Job], first_stage: str, pad: bool = False) -> None:
        self.members = members
        first = members[0]
        self.inputs = first.inputs if len(members) == 1 else {
            name: np.concatenate([member.inputs[name] for member in members])
            for name in first.inputs}
        self.rows = sum(member.rows for member in members)
        self.ids = ",".join(member.request_id for member in members if member.request_id)
        # Its sub-requests out: token -> (stage, sent at, stage timeout's end or 0, members).
        self.out: dict[object, tuple[str, float, float, list]] = {}
        self.stage = first_stage  # the stage it is in, or last entered
        # (stage, inputs, outputs) of its sub-requests that succeeded: what isolation re-uses
        # (references only, gone with the group).
        self.done: list = []
        self.batch: Batch | None = None  # its execute's
        self.lock = None  # ``batch.lock``
        self.started = 0.0
        self.pad = pad  # an isolation attempt: sub-requests padded to a full batch
        self.observed: list = []  # its stages' histogram observations, recorded at its end
        # The first failure of a sub-request that no row causes: isolating would meet it again,
        # so the members hear it.
        self.stage_failure = None

    @property
    def closed(self) -> bool:
        """Every member has an outcome: nothing more is to be sent for it."""
        for member in self.members:
            if member.outcome is None:
                return False
        return True

    def latest(self) -> Job | None:
        """The live member with the latest deadline (None once closed): its sub-requests live
        as long as it needs."""
        last = None
        for member in self.members:
            if member.outcome is None and (last is None or member.end > last.end):
                last = member
        return last

    def live(self) -> list[Job]:
        return [member for member in self.members if member.outcome is None]

    def where(self) -> str:
        """The stage it waits on (its oldest sub-request out), else the one it last entered."""
        return next(iter(self.out.values()))[0] if self.out else self.stage

    def split(self, outputs: dict) -> list[dict]:
        """The group's outputs back by member (views), each member's those it asked for.
        Raises ValueError when one asked for is missing or has not one row per row."""
        names = dict.fromkeys(name for member in self.members for name in member.outputs)
        values = {name: outputs.get(name) for name in names}
        for name, value in values.items():
            if value is None:
                raise ValueError(f"the pipeline returned no output '{name}'")
            if getattr(value, "ndim", 0) == 0 or value.shape[0] != self.rows:
                raise ValueError(f"output '{name}' has shape {getattr(value, 'shape', ())}, not "
                                 f"{self.rows} rows like the group")
        parts, start = [], 0
        for member in self.members:
            parts.append({name: values[name][start:start + member.rows]
                          for name in member.outputs})
            start += member.rows
        return parts


def form(jobs: list[Job], max_rows: int, first_stage: str) -> list[Group]:
    """``jobs`` (in arrival order) as groups of equal key, each of at most ``max_rows`` rows."""
    if len(jobs) == 1:
        return [Group(jobs, first_stage)]
    open_groups: dict[tuple, tuple[list, int]] = {}
    groups = []
    for job in jobs:
        k = key(job)
        members, rows = open_groups.get(k, ([], 0))
        if members and rows + job.rows > max_rows:
            groups.append(members)
            members, rows = [], 0
        open_groups[k] = (members + [job], rows + job.rows)
    groups += [members for members, _ in open_groups.values()]
    return [Group(members, first_stage) for members in groups]
