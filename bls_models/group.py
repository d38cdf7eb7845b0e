"""A group: requests run as one — the run function once over their stacked rows, one sub-request
per stage, each member answered from its own rows.

The requests of one ``execute`` batch form groups by what they can share: input names, trailing
shapes and dtypes (``key``), up to ``rows`` rows (the orchestrator's and every stage model's
``max_batch_size``). Requests asking for different outputs share a group: the run function
learns which rows asked for what (``Setup.rows``) and sends each stage only the rows that need
it; each member is answered with the outputs it asked for. Each member keeps its own deadline (the group's
sub-requests live as long as its latest live member's), its own answer and its request id (a
group's sub-requests carry its members' ids, comma-separated).
"""

from __future__ import annotations

import threading

import numpy as np


def key(job) -> tuple:
    """Jobs with equal keys can run as one group."""
    return tuple((name, value.dtype.str, value.shape[1:]) for name, value in job.inputs.items())


class Group:
    __slots__ = ("members", "inputs", "rows", "ids", "last", "lock", "flow", "out", "stage",
                 "started", "detached", "asked", "devices", "stage_failure", "closed", "ended",
                 "solo", "done")

    def __init__(self, members: list, first_stage: str, solo: bool = False) -> None:
        self.members = members
        first = members[0]
        self.inputs = first.inputs if len(members) == 1 else {
            name: np.concatenate([member.inputs[name] for member in members])
            for name in first.inputs}
        self.rows = sum(member.rows for member in members)
        self.ids = ",".join(member.request_id for member in members if member.request_id)
        self.last = first if len(members) == 1 else max(  # the latest deadline
            members, key=lambda member: member.deadline.end)
        self.lock = threading.Lock()  # the flow is stepped, and finished, by one thread at a time
        self.flow = None
        self.out: dict = {}           # its sub-requests out now, oldest first
        self.stage = first_stage      # the stage it is in, or about to enter
        self.started = 0.0
        self.detached = False         # execute stopped waiting: cancellation is checked
        # Whether the client was asked lately: Triton's scheduler checked cancellation as it
        # handed the requests to execute; not a request that waited for a slot since.
        self.asked = False
        self.devices: list = []       # GPU buffers its stages kept (released when it ends)
        # The first failure of a sub-request that no row causes: the group is then not re-run
        # member by member, and its members hear this failure.
        self.stage_failure = None
        self.closed = False           # its flow is over: what is still out is dropped
        self.ended = False            # closed with nothing out: its members' slots are free
        self.solo = solo              # a member's re-run alone (isolation)
        # (stage, inputs, outputs) of its sub-requests that succeeded, for isolation's re-runs
        # (``isolation.Memo``): references only, dropped with its inputs.
        self.done: list = []

    def where(self) -> str:
        """The stage it waits on (its oldest sub-request out), else the one it is about to
        enter or last entered."""
        out = list(self.out)
        return out[0].stage if out else self.stage

    def live(self) -> list:
        return [member for member in self.members if not member.answered]

    def latest(self):
        """The live member with the latest deadline (the first member when none is live): the
        group's sub-requests live as long as it needs."""
        if not self.last.answered:
            return self.last
        live = self.live()
        return max(live, key=lambda member: member.deadline.end) if live else self.members[0]

    def split(self, outputs: dict) -> list[dict]:
        """The group's outputs back by member (views), each member's those it asked for.
        Raises ValueError when one asked for is missing or does not have one row per row of
        the group."""
        names = (self.members[0].outputs if len(self.members) == 1 else
                 dict.fromkeys(name for member in self.members for name in member.outputs))
        values = {name: outputs.get(name) for name in names}
        for name, value in values.items():
            if value is None:
                raise ValueError(f"the pipeline returned no output '{name}'")
            if getattr(value, "ndim", 0) == 0 or value.shape[0] != self.rows:
                raise ValueError(f"output '{name}' has shape {getattr(value, 'shape', ())}, not "
                                 f"{self.rows} rows like the group")
        if len(self.members) == 1:
            return [values]
        parts, start = [], 0
        for member in self.members:
            parts.append({name: values[name][start:start + member.rows]
                          for name in member.outputs})
            start += member.rows
        return parts


def form(jobs: list, max_rows: int, first_stage: str) -> list[Group]:
    """``jobs`` (in arrival order) as groups of equal key, each of at most ``max_rows`` rows (a
    request larger than that is a group of its own)."""
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
