"""The accounting of runs that kill stubs: what each request was and how it ended (``Outcome``),
each stub kill and the reload it set off (``Kill``, also the recovery run's: reliability/recovery.py),
and the chaos soak's totals and verdict (``Chaos``, ``python -m reliability.chaos``), which
``account`` fills in from the outcomes, the kills and the supervisor's events. Every request lands
in exactly one place."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field

import numpy as np

from reliability import memory, supervision

KINDS = ("good", "bad_dtype", "bad_tokens", "poison", "cancel", "short_deadline")
BAD = ("bad_dtype", "bad_tokens", "poison")
ANSWER_SLACK_S = 0.5          # an answer may come this long after its deadline (+ the ingest)
LATE_SHARE = 0.005            # answers that may come later than that
AFTER_RELOAD_S = 0.5          # requests sent this soon after the switch may still meet the old copy
TRITON_QUEUE_TIMEOUT = "Request timeout expired"   # the queue policy's answer (core r24.10)


def owed_bound(model: str) -> int:
    """``max_owed_answers`` of ``model`` as committed (the default where it is not set): what
    one of its stubs killed may strand."""
    from pathlib import Path

    from bls_models.params import MAX_OWED_ANSWERS
    from bls_models.repository import load_config

    config = Path(__file__).resolve().parents[1] / "model_repository" / model / "config.pbtxt"
    if not config.exists():
        return 0
    value = load_config(config).parameters.get("max_owed_answers")
    return int(value.string_value if value is not None else MAX_OWED_ANSWERS.default)


@dataclass
class Outcome:
    """One request as the client saw it. ``result``: "ok" (answered with a success), "error"
    (answered with an error), "no answer" (nothing from the server by the client's limit),
    "cancelled" (the client cancelled it first)."""

    id: str
    model: str
    protocol: str
    kind: str
    deadline_s: float
    started: float
    finished: float
    result: str
    code: str | None = None
    answered_id: str | None = None
    message: str = ""

    @property
    def answered(self) -> bool:
        return self.result in ("ok", "error")

    @property
    def innocent(self) -> bool:
        return self.kind == "good"


@dataclass
class Kill:
    model: str
    pid: int
    at_s: float                           # seconds into the run
    detected_s: float | None = None       # kill -> the reloader started
    reloaded_s: float | None = None       # kill -> the new copy serves
    reload_s: float | None = None         # "reload: m" -> "reloaded: m"
    in_flight: int = 0                    # requests to the model in flight at the kill
    orphans: int = 0
    innocent_failed: int = 0              # innocent requests that failed "in flight at a kill"

    def follow(self, supervisor, at: float) -> float | None:
        """The reload this kill (at ``at``, monotonic) set off, from the events of ``supervisor``
        (a launcher.Supervisor): ``detected_s``, ``reloaded_s``, ``reload_s``. Returns when the
        new copy served (None: it did not)."""
        begun = supervision.reload_began(supervisor, self.model, at)
        done = supervision.reloaded(supervisor, self.model, at)
        self.detected_s = round(begun - at, 3) if begun else None
        self.reloaded_s = round(done - at, 3) if done else None
        self.reload_s = round(done - begun, 3) if begun and done else None
        return done


@dataclass
class Chaos:
    seconds: float
    concurrency: int
    seed: int
    deadline_s: float
    duration_s: float = 0.0
    sent: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> result -> count
    codes: dict[str, dict[str, int]] = field(default_factory=dict)    # kind -> error code -> n
    lost: int = 0
    duplicates: int = 0
    mismatches: int = 0
    orphans: int = 0
    orphan_bound: int = 0
    in_flight_at_kills: int = 0
    innocent_failed_at_kills: int = 0
    innocent_failed: int = 0              # anywhere else: must be 0
    bad_accepted: int = 0
    answers_late: int = 0                 # answered later than deadline + ANSWER_SLACK_S
    answers_late_beyond_ingest: int = 0   # ... beyond the client's own ingest too (the verdict's)
    ingest_ms: dict[str, dict] = field(default_factory=dict)  # "<protocol> <family>" -> p50, p99
    answers_late_by_triton_queue: int = 0  # of which Triton's queue answered (a queue timeout)
    answers_late_at_kills: int = 0        # of which in flight while a model was reloading
    worst_excess_s: float = 0.0           # the latest answer past its deadline (negative: none)
    worst_excess_id: str = ""
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # innocent, per model
    kills: list[Kill] = field(default_factory=list)
    reloads: int = 0
    reload_failures: list[str] = field(default_factory=list)
    server_restarts: int = 0
    supervisor_error: str = ""
    events: list[str] = field(default_factory=list)  # the reloader's and the supervisor's
    memory_growth_mib_per_10k: dict[str, float] = field(default_factory=dict)
    memory_mib: dict[str, tuple[float, float]] = field(default_factory=dict)  # first, last
    samples: list[dict] = field(default_factory=list)
    # Every request that did not end as its kind should (by id): failures, orphans, lost.
    notable: list[dict] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(counts.get("ok", 0) + counts.get("error", 0)
                   for counts in self.by_kind.values())

    def allowance_s(self, o: "Outcome") -> float:
        """The client's own ingest for ``o``'s protocol and family: its p99, seconds."""
        family = "tag_pipeline" if o.model.startswith("tag_") else "pipeline"
        return self.ingest_ms.get(f"{o.protocol} {family}", {}).get("p99", 0.0) / 1e3

    @property
    def clean(self) -> bool:
        return (self.lost == 0 and self.duplicates == 0 and self.mismatches == 0
                and self.orphans <= self.orphan_bound and self.innocent_failed == 0
                and self.bad_accepted == 0
                and self.answers_late_beyond_ingest <= LATE_SHARE * self.answered
                and self.server_restarts == 0 and not self.reload_failures
                and not self.supervisor_error
                and all(k.reloaded_s is not None for k in self.kills))


def account(chaos: Chaos, outcomes: list[Outcome], kills: list[tuple[Kill, float]],  # noqa: C901 - one rule per outcome
            supervisor, started: float) -> None:
    """Every outcome into its place (see reliability/chaos.py's docstring), the kills with their
    reloads (``supervisor``: a launcher.Supervisor), the memory trends."""
    events = list(supervisor.reloader.events)
    windows = []  # (model, kill time, until when a request may still meet the old copy, kill)
    for kill, at in kills:
        done = kill.follow(supervisor, at)
        windows.append((kill.model, at, (done + AFTER_RELOAD_S) if done else float("inf"), kill))
    chaos.kills = [kill for kill, _ in kills]
    chaos.reloads = sum(1 for _, what in events if what.startswith("reloaded: "))
    chaos.reload_failures = [what for _, what in events
                             if what.startswith(("reload failed", "gave up"))]
    chaos.server_restarts = supervision.server_restarts(supervisor)
    chaos.supervisor_error = str(supervisor.error or "")
    chaos.events = supervision.timeline(supervisor, started)

    def at_kill(o: Outcome) -> Kill | None:
        """The kill whose model ``o`` went to while it was in flight (sent before the new copy
        served, ended after the kill)."""
        return next((kill for model, at, until, kill in windows
                     if o.model == model and o.started <= until and o.finished >= at), None)

    def in_flight_at(o: Outcome) -> Kill | None:
        return next((kill for model, at, _, kill in windows
                     if o.model == model and o.started < at <= o.finished), None)

    answers = collections.Counter(o.answered_id for o in outcomes if o.result == "ok")
    chaos.duplicates = sum(n - 1 for n in answers.values() if n > 1)
    chaos.mismatches = sum(1 for o in outcomes if o.result == "ok" and o.answered_id != o.id)
    chaos.lost = chaos.sent - len(outcomes)  # a client that never recorded its request
    latencies: dict[str, list[float]] = collections.defaultdict(list)
    worst = None
    for o in outcomes:
        kind = chaos.by_kind.setdefault(o.kind, {})
        kind[o.result] = kind.get(o.result, 0) + 1
        if o.code is not None:
            codes = chaos.codes.setdefault(o.kind, {})
            codes[o.code] = codes.get(o.code, 0) + 1
        flight = in_flight_at(o)
        if flight is not None:
            flight.in_flight += 1
        why = None
        if o.result == "no answer":
            if flight is not None:
                flight.orphans += 1
                why = "orphan"
            else:
                chaos.lost += 1
                why = "lost"
        elif o.answered:
            excess = o.finished - o.started - o.deadline_s
            if worst is None or excess > worst[0]:
                worst = (excess, o.id)
            if excess > ANSWER_SLACK_S:
                chaos.answers_late += 1
                why = "late, within the client's own ingest"
                if excess - chaos.allowance_s(o) > ANSWER_SLACK_S:
                    chaos.answers_late_beyond_ingest += 1
                    why = "late"
                if o.result == "error" and TRITON_QUEUE_TIMEOUT in o.message:
                    chaos.answers_late_by_triton_queue += 1
                    why = "late, by Triton's queue"
                if any(o.started <= until and o.finished >= at for _, at, until, _ in windows):
                    chaos.answers_late_at_kills += 1  # a reload's CPU slows every model
                    why += ", during a reload"
            if o.kind in BAD and o.result == "ok":
                chaos.bad_accepted += 1
                why = "bad input accepted"
            if o.innocent and o.result == "error":
                kill = at_kill(o)
                if kill is not None:
                    kill.innocent_failed += 1
                    why = why or "innocent, in flight at a kill"
                else:
                    chaos.innocent_failed += 1
                    why = "innocent failed"
            if o.innocent and o.result == "ok":
                latencies[o.model].append(o.finished - o.started)
        if why:
            chaos.notable.append({**asdict(o), "why": why,
                                  "started_s": round(o.started - started, 3),
                                  "seconds": round(o.finished - o.started, 3)})
    chaos.orphans = sum(k.orphans for k in chaos.kills)
    chaos.in_flight_at_kills = sum(k.in_flight for k in chaos.kills)
    chaos.innocent_failed_at_kills = sum(k.innocent_failed for k in chaos.kills)
    # Owed past execute (max_owed_answers per killed instance): r24.10 never answers those.
    chaos.orphan_bound = sum(owed_bound(kill.model) for kill in chaos.kills)
    if worst is not None:
        chaos.worst_excess_s, chaos.worst_excess_id = round(worst[0], 3), worst[1]
    chaos.latency_ms = {m: {"p50": float(np.percentile(v, 50) * 1e3),
                            "p99": float(np.percentile(v, 99) * 1e3), "n": len(v)}
                        for m, v in sorted(latencies.items())}
    chaos.memory_mib, chaos.memory_growth_mib_per_10k = memory.trends(chaos.samples,
                                                                      len(outcomes))
