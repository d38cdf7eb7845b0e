"""`python -m bench.chaos` (`make soak CHAOS=1`): the soak with faults thrown in — bad inputs,
cancelled calls, deadlines too short to meet, and an orchestrator stub SIGKILLed every 90 s —
and an account of every request.

    python -m bench.chaos                          # 20 minutes at concurrency 256
    python -m bench.chaos --quick                  # ~60 s, one kill (a smoke run)
    python -m bench.chaos --seconds 300 --kill-every 60 --seed 7

It starts its own server, as the test suite does: the committed repository plus the test-only
variants (``bench.experiments.build_test_repository``), with the launcher's ``Supervisor`` (it
reloads a model whose stub died), so every reload and every whole-server restart is known.
``--concurrency`` closed-loop clients on one asyncio loop, a quarter of them over HTTP and the
rest over gRPC, send `pipeline` (``1 - --tag-share`` of the clients) and `tag_pipeline` requests
(an eighth: a `tag_pipeline` request costs the host several `pipeline` ones) until ``--seconds``
have passed. Each request draws, from a generator seeded by ``--seed`` and
the client's number, what it is:

- 5 % bad inputs: the wrong datatype (both models), out-of-range token ids (`tag_pipeline`), or
  a poisoned image sent to `pipeline_poison_embedder`, whose embedder stage is a model that
  fails its whole batch on one poisoned item (``modelgen/poison.py``). Half the good image
  requests go there too, as the batch-mates that must not fail with it: poisoned images are
  then ~5.6 % of that model's requests, as bad inputs are of every model's (with a tenth they
  were 23 %: docs/reliability.md);
- 5 % cancelled by the client after 1-200 ms (the asyncio task is cancelled: gRPC cancels the
  call, HTTP closes its connection);
- 5 % with a deadline too short to meet (a Triton timeout of 1-5 ms);
- the rest innocent: good input, a ``--deadline-s`` deadline (10 s), never cancelled. A longer
  one buys little: the stage models' queues time a sub-request out after 10 s (their
  ``default_timeout_microseconds``) whatever the request's deadline.

Every request carries a unique id, its deadline as Triton's timeout, and a client-side limit of
deadline + ``--grace-s`` (30 s: so nothing waits forever, and an answer that comes late is
counted late, not lost — earlier runs with 5 s could not tell the two apart). Every ``--kill-every`` seconds (the first
kill half an interval in) one stub that serves `pipeline`, then `tag_pipeline`, and so on, is
SIGKILLed: never one the reloader retired. At 90 s that is 3.3 reloads per model in 10 minutes,
inside the crash-loop guard of 5.

What the run guarantees, each checked in the verdict (``Chaos.clean``):

- every request is accounted for exactly once: 0 lost (no server answer by the client's limit),
  0 duplicated or mismatched ids on answers, except the **orphans**: requests in flight on a
  killed stub's model at the kill that got no server answer (r24.10 never answers a request
  owed through a response sender when its stub died: docs/reliability.md). Orphans are counted
  apart and bounded: at most 1 per kill or 5 % of the requests in flight at the kills;
- innocent requests never fail, except those **in flight at a kill**: to the killed model,
  ending after the kill and sent before its new copy served (+0.5 s);
- bad inputs are never answered with a success;
- every server answer comes within its deadline + 0.5 s, client-measured (the worst excess is
  reported). Those Triton's own queue answered ("Request timeout expired": r24.10 rejects an
  expired request only when its batcher reaches it, docs/reliability.md) are counted apart
  from the orchestrators' answers, and both count against the verdict;
- 0 whole-server restarts, every kill followed by a reload, none failed.

It also reports each reload's duration, the error codes per kind of request, and memory every
2 s: tritonserver's resident memory, the private memory of the serving stubs of each model (the
retired ones apart), and the python backend's shared-memory regions in /dev/shm, each as a
growth per 10 000 requests after warm-up (``bench.soak.growth_per_10k``). It writes
``chaos.json``, ``chaos.csv`` (the memory samples), ``chaos.png`` and ``chaos.md`` into
``--out``, every request's outcome by id into ``--raw`` (git-ignored), and exits non-zero unless
the run was clean.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.soak import growth_per_10k
from bls_models import spec as S
from modelgen import poison
from tritonlocal import launcher, procs

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("pipeline", "tag_pipeline")            # the load, and the stubs that are killed
POISON_MODEL = "pipeline_poison_embedder"        # its embedder stage fails a poisoned batch
WATCHED = (*MODELS, POISON_MODEL)                # stubs whose memory is reported one by one
KINDS = ("good", "bad_dtype", "bad_tokens", "poison", "cancel", "short_deadline")
BAD = ("bad_dtype", "bad_tokens", "poison")
ANSWER_SLACK_S = 0.5          # an answer may come this long after its deadline
AFTER_RELOAD_S = 0.5          # requests sent this soon after the switch may still meet the old copy
MIB = 2**20
RAMP_S = 5.0
TRITON_QUEUE_TIMEOUT = "Request timeout expired"   # the queue policy's answer (core r24.10)
SHOWN = 50                    # requests of each reason listed in chaos.md (and kept in chaos.json)


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
    def clean(self) -> bool:
        return (self.lost == 0 and self.duplicates == 0 and self.mismatches == 0
                and self.orphans <= self.orphan_bound and self.innocent_failed == 0
                and self.bad_accepted == 0 and self.answers_late == 0
                and self.server_restarts == 0 and not self.reload_failures
                and not self.supervisor_error
                and all(k.reloaded_s is not None for k in self.kills))


# -- what each request sends --------------------------------------------------------------------
class Inputs:
    """The tensors of every kind of request, made once (numpy only: no torch in the client)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(29)
        image = rng.integers(0, 256, (1, *S.IMAGE.dims), dtype=np.uint8)
        image[0, 0, 0, :] = 0  # never the poison colour by chance
        tokens = rng.integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN), dtype=np.int64)
        out_of_range = tokens.copy()
        out_of_range[0, S.TAGGER_SEQ_LEN // 2] = S.TAGGER_VOCAB + 7
        self.good = {"pipeline": ("IMAGE", "UINT8", image),
                     "tag_pipeline": ("TOKENS", "INT64", tokens)}
        self.bad_dtype = {"pipeline": ("IMAGE", "FP32", image.astype(np.float32)),
                          "tag_pipeline": ("TOKENS", "INT32", tokens.astype(np.int32))}
        self.bad_tokens = ("TOKENS", "INT64", out_of_range)
        self.poisoned = ("IMAGE", "UINT8", poison.poison_image(image))


@dataclass
class Request:
    model: str           # the model the request goes to
    family: str          # the model whose clients send it (pipeline or tag_pipeline)
    kind: str
    tensor: tuple[str, str, np.ndarray]
    deadline_s: float
    limit_s: float       # the client stops waiting after this (cancel: its delay)


def draw(rng: np.random.Generator, family: str, inputs: Inputs, deadline_s: float,
         grace_s: float, poison_mates: float = 0.5) -> Request:
    """What one request of a ``family`` client is: 5 % bad input, 5 % cancelled, 5 % a deadline
    too short to meet, the rest innocent."""
    roll = rng.random()
    model, tensor, deadline = family, inputs.good[family], deadline_s
    if roll < 0.05:
        other = "poison" if family == "pipeline" else "bad_tokens"
        kind = other if rng.random() < 0.5 else "bad_dtype"
        if kind == "bad_dtype":
            tensor = inputs.bad_dtype[family]
        elif kind == "poison":
            model, tensor = POISON_MODEL, inputs.poisoned
        else:
            tensor = inputs.bad_tokens
    elif roll < 0.10:
        kind = "cancel"
        return Request(model, family, kind, tensor, deadline, float(rng.uniform(0.001, 0.2)))
    elif roll < 0.15:
        kind, deadline = "short_deadline", float(rng.integers(1, 6)) / 1e3
    else:
        kind = "good"
        if family == "pipeline" and rng.random() < poison_mates:
            model = POISON_MODEL  # a batch-mate for the poisoned ones: it must not fail with them
    return Request(model, family, kind, tensor, deadline, deadline + grace_s)


# -- memory of the server's processes -------------------------------------------------------------
def shm_regions() -> list[Path]:
    """The python backend's shared-memory regions of the servers this process started (the
    launcher names them ``tritonlocal_<launcher pid>_...``; Triton's default prefix is
    ``triton_python_backend_shm_region_``)."""
    return launcher.shm_regions(f"{launcher.SHM_PREFIX}{os.getpid()}_")


def process_memory(server_pid: int, retired: set[int]) -> dict[str, float]:
    """MiB: tritonserver's resident memory, the summed private memory (RssAnon) of the serving
    stubs of each watched model and of every other model, that of the retired stubs still
    alive, and the shared-memory regions (the space they take in /dev/shm, and how many)."""
    memory: dict[str, float] = collections.defaultdict(float)
    memory["tritonserver RSS"] = procs.memory_mib(server_pid).get("VmRSS", 0.0)
    for model, pids in launcher.group_stubs(server_pid).items():
        for pid in pids:
            private = procs.memory_mib(pid).get("RssAnon", 0.0)
            if pid in retired:
                memory["retired stubs private"] += private
            elif model in WATCHED:
                memory[f"{model} stubs private"] += private
            else:
                memory["other models' stubs private"] += private
    regions = shm_regions()
    taken = 0
    for region in regions:
        try:
            taken += region.stat().st_blocks * 512  # pages actually in /dev/shm, not the size
        except OSError:
            continue
    memory["shm regions"] = taken / MIB
    memory["shm region count"] = float(len(regions))
    return dict(memory)


# -- the run --------------------------------------------------------------------------------------
async def run(server: launcher.TritonServer, supervisor: launcher.Supervisor, seconds: float,
              concurrency: int = 256, seed: int = 29, deadline_s: float = 10.0,
              grace_s: float = 30.0, kill_every: float = 90.0, tag_share: float = 0.125,
              http_share: float = 0.25, sample_every: float = 2.0, progress=print,
              outcomes: list[Outcome] | None = None, poison_mates: float = 0.5) -> Chaos:
    """The chaos load against ``server`` (watched by ``supervisor``, already started) for
    ``seconds``, then every request still in flight awaited, the last reload waited for, and
    the accounting done. Each request's outcome is appended to ``outcomes`` if given."""
    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http.aio as httpaio
    from tritonclient.utils import InferenceServerException

    chaos = Chaos(seconds, concurrency, seed, deadline_s)
    inputs = Inputs()
    grpc = grpcaio.InferenceServerClient(server.grpc_url)
    http = httpaio.InferenceServerClient(server.http_url, conn_limit=concurrency,
                                         conn_timeout=deadline_s + grace_s + 30)
    outcomes = [] if outcomes is None else outcomes
    kills: list[tuple[Kill, float]] = []   # (kill, monotonic time)
    started = time.monotonic()
    stop_at = started + seconds
    tag_clients = round(concurrency * tag_share)
    http_every = max(1, round(1 / http_share)) if http_share > 0 else 0

    async def infer(protocol: str, request: Request, request_id: str) -> str | None:
        name, dtype, data = request.tensor
        timeout_us = max(1, int(request.deadline_s * 1e6))
        if protocol == "grpc":
            tensor = grpcaio.InferInput(name, list(data.shape), dtype)
            tensor.set_data_from_numpy(data)
            result = await grpc.infer(request.model, [tensor], request_id=request_id,
                                      timeout=timeout_us)
            return result.get_response().id
        tensor = httpaio.InferInput(name, list(data.shape), dtype)
        tensor.set_data_from_numpy(data)
        result = await http.infer(request.model, [tensor], request_id=request_id,
                                  timeout=timeout_us)
        return result.get_response().get("id")

    async def client(index: int) -> None:
        rng = np.random.default_rng([seed, index])
        family = "tag_pipeline" if index < tag_clients else "pipeline"
        protocol = "http" if http_every and index % http_every == http_every - 1 else "grpc"
        sequence = 0
        # Clients join over the first RAMP_S: 256 requests at once on a cold server would time
        # out innocents for the warm-up alone (ONNX Runtime's arenas grow on the first batches).
        await asyncio.sleep(RAMP_S * index / concurrency)
        while time.monotonic() < stop_at:
            request = draw(rng, family, inputs, deadline_s, grace_s, poison_mates)
            request_id = f"chaos-{index}-{sequence}"
            sequence += 1
            chaos.sent += 1
            began = time.monotonic()
            code = answered_id = None
            message = ""
            try:
                answered_id = await asyncio.wait_for(infer(protocol, request, request_id),
                                                     request.limit_s)
                result = "ok"
            except asyncio.TimeoutError:
                result = "cancelled" if request.kind == "cancel" else "no answer"
            except InferenceServerException as error:
                result, code, message = "error", str(error.status()), error.message() or ""
            except Exception as error:  # noqa: BLE001 - a reset connection is an answer too
                result, code, message = "error", type(error).__name__, str(error)
            outcomes.append(Outcome(request_id, request.model, protocol, request.kind,
                                    request.deadline_s, began, time.monotonic(), result, code,
                                    answered_id, message[:300]))
            if result == "error" and request.kind == "good":
                await asyncio.sleep(0.05)  # a failing model is not hammered in a tight loop

    async def chaos_monkey() -> None:
        """SIGKILL a serving stub of pipeline, then tag_pipeline, ... every ``kill_every``."""
        number = 0
        while True:
            at = started + (number + 0.5) * kill_every
            if at > stop_at - min(10.0, kill_every / 2):
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            model = MODELS[number % len(MODELS)]
            number += 1
            retired = supervisor.reloader.retired
            serving = [pid for pid in await asyncio.to_thread(server.stub_pids, model)
                       if pid not in retired]
            if not serving:
                progress(f"chaos: no serving stub of {model} to kill; skipped")
                continue
            pick = np.random.default_rng([seed, 10_000 + number])
            victim = serving[int(pick.integers(len(serving)))]
            when = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            kills.append((Kill(model, victim, round(when - started, 2)), when))
            progress(f"chaos: {when - started:6.1f} s  SIGKILL {model} stub {victim}")

    async def watch() -> None:
        last_report = started
        while True:
            process = server.process
            if process is None:  # between the stop and the start of a whole-server restart
                await asyncio.sleep(sample_every)
                continue
            memory = await asyncio.to_thread(process_memory, process.pid,
                                             supervisor.reloader.retired)
            now = time.monotonic()
            chaos.samples.append({"seconds": round(now - started, 2), "completed": len(outcomes),
                                  **memory})
            if now - last_report >= 30:
                last_report = now
                results = collections.Counter(o.result for o in outcomes)
                progress(f"chaos: {now - started:6.1f} s  {len(outcomes)} done "
                         f"({dict(results)}), {chaos.sent - len(outcomes)} in flight, "
                         f"tritonserver {memory['tritonserver RSS']:.0f} MiB, "
                         f"shm {memory['shm regions']:.0f} MiB")
            await asyncio.sleep(sample_every)

    watcher = asyncio.create_task(watch())
    monkey = asyncio.create_task(chaos_monkey())
    try:
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    finally:
        monkey.cancel()
        watcher.cancel()
        await grpc.close()
        await http.close()
    chaos.duration_s = time.monotonic() - started
    # The last kill's reload, if the load ended before it did.
    until = time.monotonic() + 60
    while time.monotonic() < until and kills and not supervisor.error and not all(
            _reloaded_after(supervisor, kill.model, at) for kill, at in kills):
        await asyncio.sleep(0.2)
    if server.process is not None:
        chaos.samples.append({"seconds": round(time.monotonic() - started, 2),
                              "completed": len(outcomes),
                              **process_memory(server.process.pid, supervisor.reloader.retired)})
    account(chaos, outcomes, kills, supervisor, started)
    return chaos


def _reloaded_after(supervisor: launcher.Supervisor, model: str, at: float) -> float | None:
    return next((t for t, what in supervisor.reloader.events
                 if t > at and what == f"reloaded: {model}"), None)


def account(chaos: Chaos, outcomes: list[Outcome], kills: list[tuple[Kill, float]],
            supervisor: launcher.Supervisor, started: float) -> None:
    """Every outcome into its place (see the module's docstring), the kills with their reloads,
    the memory trends."""
    events = list(supervisor.reloader.events)
    windows = []  # (model, kill time, until when a request may still meet the old copy, kill)
    for kill, at in kills:
        begun = next((t for t, what in events
                      if t > at and what.startswith(f"reload: {kill.model}:")), None)
        done = _reloaded_after(supervisor, kill.model, at)
        kill.detected_s = round(begun - at, 3) if begun else None
        kill.reloaded_s = round(done - at, 3) if done else None
        kill.reload_s = round(done - begun, 3) if begun and done else None
        windows.append((kill.model, at, (done + AFTER_RELOAD_S) if done else float("inf"), kill))
    chaos.kills = [kill for kill, _ in kills]
    chaos.reloads = sum(1 for _, what in events if what.startswith("reloaded: "))
    chaos.reload_failures = [what for _, what in events
                             if what.startswith(("reload failed", "gave up"))]
    chaos.server_restarts = sum(1 for _, what in supervisor.events if what.startswith("restart"))
    chaos.supervisor_error = str(supervisor.error or "")
    chaos.events = [f"{t - started:+.2f} s {who}: {what}" for t, who, what in sorted(
        [(t, "reloader", what) for t, what in events]
        + [(t, "supervisor", what) for t, what in supervisor.events])]

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
    chaos.orphan_bound = max(len(chaos.kills), int(0.05 * chaos.in_flight_at_kills))
    if worst is not None:
        chaos.worst_excess_s, chaos.worst_excess_id = round(worst[0], 3), worst[1]
    chaos.latency_ms = {m: {"p50": float(np.percentile(v, 50) * 1e3),
                            "p99": float(np.percentile(v, 99) * 1e3), "n": len(v)}
                        for m, v in sorted(latencies.items())}
    total = len(outcomes)
    keys = sorted({k for s in chaos.samples for k in s} - {"seconds", "completed"})
    for key in keys:
        values = [s[key] for s in chaos.samples if key in s]
        chaos.memory_mib[key] = (values[0], values[-1])
        chaos.memory_growth_mib_per_10k[key] = growth_per_10k(chaos.samples, key, total)


# -- report ---------------------------------------------------------------------------------------
def shown(chaos: Chaos, limit: int = SHOWN) -> list[dict]:
    """The first ``limit`` notable requests of each reason."""
    seen: collections.Counter = collections.Counter()
    kept = []
    for n in chaos.notable:
        seen[n["why"]] += 1
        if seen[n["why"]] <= limit:
            kept.append(n)
    return kept


def report(chaos: Chaos, out: Path, command: str, raw: Path | None = None,
           outcomes: list[Outcome] | None = None) -> Path:
    """chaos.{json,csv,png,md} into ``out``; every request's outcome, one JSON line each, into
    ``raw``/chaos-requests.jsonl (raw data: not for git)."""
    out.mkdir(parents=True, exist_ok=True)
    if raw is not None and outcomes is not None:
        raw.mkdir(parents=True, exist_ok=True)
        with (raw / "chaos-requests.jsonl").open("w") as handle:
            for o in outcomes:
                handle.write(json.dumps(asdict(o)) + "\n")
    summary = {**asdict(chaos), "notable": shown(chaos), "clean": chaos.clean,
               "command": command}
    (out / "chaos.json").write_text(json.dumps(summary, indent=1) + "\n")
    keys = sorted({k for s in chaos.samples for k in s} - {"seconds", "completed"})
    with (out / "chaos.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["seconds", "completed", *keys])
        writer.writeheader()
        writer.writerows(chaos.samples)
    plotted = _plot(chaos, out / "chaos.png", keys)
    total = sum(sum(r.values()) for r in chaos.by_kind.values())
    rate = total / chaos.duration_s if chaos.duration_s else 0.0
    results = ("ok", "error", "cancelled", "no answer")
    lines = [f"# Chaos soak: {chaos.seconds:.0f} s at concurrency {chaos.concurrency}", "",
             f"`{command}` — {chaos.duration_s:.0f} s, {total} requests ({rate:.0f} req/s), seed "
             f"{chaos.seed}, {time.strftime('%Y-%m-%d %H:%M')} on this host ({os.cpu_count()} "
             f"cores). Verdict: **{'clean' if chaos.clean else 'NOT clean'}**.", "",
             "| kind | " + " | ".join(results) + " | error codes |",
             "|---|" + "---|" * (len(results) + 1)]
    for kind in KINDS:
        if kind in chaos.by_kind:
            counts = chaos.by_kind[kind]
            lines.append(f"| {kind} | " + " | ".join(str(counts.get(r, 0)) for r in results)
                         + " | " + ", ".join(f"{c}: {n}" for c, n in
                                             sorted(chaos.codes.get(kind, {}).items())) + " |")
    lines += ["",
              f"- lost: **{chaos.lost}**; duplicates: **{chaos.duplicates}**; mismatched ids: "
              f"**{chaos.mismatches}**",
              f"- orphans (in flight on a killed stub's model, never answered; r24.10): "
              f"**{chaos.orphans}** of {chaos.in_flight_at_kills} in flight at the kills "
              f"(bound {chaos.orphan_bound})",
              f"- innocent requests failed: **{chaos.innocent_failed}** elsewhere, "
              f"{chaos.innocent_failed_at_kills} in flight at a kill",
              f"- bad inputs answered with a success: **{chaos.bad_accepted}**",
              f"- answers later than deadline + {ANSWER_SLACK_S} s: **{chaos.answers_late}**, "
              f"{chaos.answers_late_by_triton_queue} of them by Triton's queue "
              f"(\"{TRITON_QUEUE_TIMEOUT}\"), {chaos.answers_late_at_kills} in flight during a "
              f"reload; worst excess over the deadline {chaos.worst_excess_s:+.3f} s "
              f"(`{chaos.worst_excess_id}`)",
              f"- whole-server restarts: **{chaos.server_restarts}**; reloads: {chaos.reloads} "
              f"for {len(chaos.kills)} kills; failed reloads: {chaos.reload_failures or 'none'}"
              + (f"; supervisor stopped: {chaos.supervisor_error}"
                 if chaos.supervisor_error else ""),
              "- innocent latency: " + "; ".join(
                  f"`{m}` p50 {v['p50']:.0f} ms, p99 {v['p99']:.0f} ms ({v['n']})"
                  for m, v in chaos.latency_ms.items()), "",
              "| kill at (s) | model | stub | kill → reload starts (s) | reload (s) | kill → "
              "serving (s) | in flight | orphans | innocent failed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k in chaos.kills:
        lines.append(f"| {k.at_s:.1f} | `{k.model}` | {k.pid} | {k.detected_s} | {k.reload_s} | "
                     f"{k.reloaded_s} | {k.in_flight} | {k.orphans} | {k.innocent_failed} |")
    lines += ["", "| memory | first → last sample | growth per 10 000 requests after warm-up |",
              "|---|---|---|"]
    for key, (first, last) in sorted(chaos.memory_mib.items(), key=lambda kv: -kv[1][1]):
        unit = "" if key.endswith("count") else " MiB"
        lines.append(f"| {key} | {first:.0f} → {last:.0f}{unit} | "
                     f"{chaos.memory_growth_mib_per_10k.get(key, float('nan')):+.1f}{unit} |")
    reasons = collections.Counter((n["why"], n["model"], n["code"] or n["result"])
                                  for n in chaos.notable)
    if reasons:
        lines += ["", "Requests that did not end as their kind should, by reason (every "
                      "request's outcome: `chaos-requests.jsonl` in the raw directory):", "",
                  "| reason | model | code | requests |", "|---|---|---|---|"]
        lines += [f"| {why} | `{model}` | {code} | {n} |"
                  for (why, model, code), n in sorted(reasons.items())]
    listed = [n for n in shown(chaos, 10) if n["why"] != "innocent, in flight at a kill"]
    if listed:
        lines += ["", "The first 10 of each reason (more in chaos.json):", ""]
        lines += [f"- `{n['id']}` {n['model']} {n['protocol']} {n['kind']}: {n['why']}, "
                  f"{n['result']} {n['code'] or ''} after {n['seconds']} s (sent at "
                  f"{n['started_s']} s) {n['message'][:120]}" for n in listed]
    if plotted:
        lines += ["", "![memory over the run](chaos.png)"]
    path = out / "chaos.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot(chaos: Chaos, path: Path, keys: list[str]) -> bool:
    if len(chaos.samples) < 2:
        return False
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for key in keys:
        if not key.endswith("count"):
            ax.plot([s["completed"] for s in chaos.samples],
                    [s.get(key, float("nan")) for s in chaos.samples], label=key)
    for kill in chaos.kills:
        done = [s["completed"] for s in chaos.samples if s["seconds"] >= kill.at_s]
        if done:
            ax.axvline(done[0], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("requests completed (dotted: a stub SIGKILLed)")
    ax.set_ylabel("MiB")
    ax.set_title(f"Chaos soak: {chaos.seconds:.0f} s at concurrency {chaos.concurrency}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, help="how long the load runs (1200; --quick: 60)")
    parser.add_argument("--quick", action="store_true",
                        help="a ~60 s smoke run: 60 s with one kill (30 s in)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--kill-every", type=float, help="seconds between stub kills (90)")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--deadline-s", type=float, default=10.0, help="the normal deadline")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="the client waits this long past a request's deadline")
    parser.add_argument("--tag-share", type=float, default=0.125,
                        help="share of the clients sending tag_pipeline requests")
    parser.add_argument("--http-share", type=float, default=0.25, help="share of HTTP clients")
    parser.add_argument("--poison-mates", type=float, default=0.5,
                        help="share of the good image requests sent to the poisoned model (0.5: "
                             "poisoned images are ~5.6 %% of its requests; 0.1: 23 %%, 5x fewer)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--raw", type=Path, default=ROOT / "bench" / "results" / "raw",
                        help="where every request's outcome goes (git-ignored)")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args(argv)
    command = "python -m bench.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    seconds = args.seconds or (60.0 if args.quick else 1200.0)
    kill_every = args.kill_every or (60.0 if args.quick else 90.0)

    from bench import experiments

    # The server's log is kept (.triton/, git-ignored) to explain a run that was not clean.
    log = ROOT / ".triton" / f"chaos-tritonserver-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as scratch:
        variants = experiments.build_test_repository(Path(scratch) / "variants",
                                                     args.model_repository)
        options = launcher.on_free_ports(args.model_repository, log, stop_grace=5.0,
                                         extra_args=[f"--model-repository={variants}"])
        with launcher.TritonServer(options) as server:
            print(f"server log: {log}", flush=True)
            supervisor = launcher.Supervisor(server, restart_grace=5.0, retire_grace=5.0,
                                             log=lambda line: print(f"  {line}", flush=True))
            supervisor.start()
            outcomes: list[Outcome] = []
            try:
                chaos = asyncio.run(run(server, supervisor, seconds, args.concurrency, args.seed,
                                        args.deadline_s, args.grace_s, kill_every,
                                        args.tag_share, args.http_share,
                                        progress=lambda line: print(line, flush=True),
                                        outcomes=outcomes, poison_mates=args.poison_mates))
            finally:
                supervisor.stop()
    path = report(chaos, args.out, command.strip(), args.raw, outcomes)
    print(path.read_text())
    return 0 if chaos.clean else 1


if __name__ == "__main__":
    sys.exit(main())
