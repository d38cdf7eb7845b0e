"""A request (``Job``) and a group of them run as one on their stacked rows (``Group``).
Requests of equal input names, dtypes and trailing shapes form groups of up to the stages'
``max_batch_size`` rows; each member keeps its own deadline and outcome. A group is ``closed``
once every member has one. Outcomes and sub-requests out change under the orchestrator's lock.
"""

from __future__ import annotations

import numpy as np


class Job:
    """One client request, from ``execute`` until its answer. ``outcome`` is set once, under the
    orchestrator's lock: the outputs of its own rows, or a ``PipelineError``."""

    __slots__ = ("request", "request_id", "arrived", "end", "limit", "budget_ms", "inputs",
                 "rows", "outputs", "outcome", "answered", "sender")

    def __init__(self, request, request_id: str, now: float, timeout_us: int,
                 default_ms: int, max_ms: int) -> None:
        self.request = request  # until answered (owed ones past execute)
        self.request_id, self.arrived = request_id, now
        if timeout_us <= 0:
            self.limit, self.budget_ms = "default deadline", default_ms
        elif timeout_us > max_ms * 1e3:
            self.limit, self.budget_ms = "client timeout cut to max_deadline_ms", max_ms
        else:
            self.limit, self.budget_ms = "client timeout", timeout_us / 1e3
        self.end = now + self.budget_ms / 1e3  # deadlines count from arrival in execute
        self.inputs, self.rows, self.outputs, self.outcome = {}, 0, [], None
        self.answered = False  # its response was sent (execute's thread only)
        self.sender = None  # its response sender, got before it is owed past execute


class Group:
    __slots__ = ("members", "inputs", "rows", "ids", "out", "stage", "done", "started", "pad",
                 "observed", "stage_failure", "keep")

    def __init__(self, members: list[Job], first_stage: str, started: float = 0.0,
                 pad: bool = False) -> None:
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
        self.done: list = []  # (stage, inputs, outputs) that succeeded: what isolation re-uses
        self.started = started  # when its execute began
        self.pad = pad  # an isolation attempt: sub-requests padded to a full batch
        self.observed: list = []  # its stages' histogram observations, recorded at its end
        self.stage_failure = None  # the first failure no row causes: its members hear it
        self.keep: dict = {}  # stage -> outputs kept where they are (gpu_tensors), for this run

    @property
    def closed(self) -> bool:
        """Every member has an outcome: nothing more is to be sent for it."""
        return all(member.outcome is not None for member in self.members)

    def latest(self) -> Job | None:
        """The live member with the latest deadline (None once closed)."""
        return max(self.live(), key=lambda member: member.end, default=None)

    def live(self) -> list[Job]:
        return [member for member in self.members if member.outcome is None]

    def where(self) -> str:
        """The stage it waits on (its oldest sub-request out), else the one it last entered."""
        return next(iter(self.out.values()))[0] if self.out else self.stage

    def split(self, outputs: dict) -> list[dict]:
        """The group's outputs by member (views), those it asked for; ValueError if one is
        missing or has not one row per row."""
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

    @staticmethod
    def form(jobs: list[Job], max_rows: int, first_stage: str, started: float) -> list["Group"]:
        """``jobs`` (in arrival order) as groups of equal key, each of at most ``max_rows``
        rows."""
        open_groups: dict[tuple, tuple[list, int]] = {}
        groups = []
        for job in jobs:
            k = tuple((n, v.dtype.str, v.shape[1:]) for n, v in job.inputs.items())
            members, rows = open_groups.get(k, ([], 0))
            if members and rows + job.rows > max_rows:
                groups.append(members)
                members, rows = [], 0
            open_groups[k] = (members + [job], rows + job.rows)
        groups += [members for members, _ in open_groups.values()]
        return [Group(members, first_stage, started) for members in groups]
