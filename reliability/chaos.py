"""`python -m reliability.chaos` (`make soak CHAOS=1`): the soak with faults thrown in — bad inputs,
cancelled calls, deadlines too short to meet, an orchestrator stub SIGKILLed every 90 s — and an
account of every request (docs/reliability.md, "Chaos soak").

    python -m reliability.chaos                          # 20 minutes at concurrency 256
    python -m reliability.chaos --quick                  # ~60 s, one kill (a smoke run)
    python -m reliability.chaos --seconds 300 --kill-every 60 --seed 7

Its own server serves the committed repository and the test-only models
(``bench.repository.build_test_repository``), watched by the launcher's ``Supervisor``.
Closed-loop clients (a quarter over HTTP) send `pipeline` and `tag_pipeline` requests, each drawn
(``draw``, seeded) as 5 % bad input, 5 % cancelled, 5 % a deadline too short to meet, the rest
innocent; every request carries a unique id and a deadline.

Guarantees, each checked in the verdict (``Chaos.clean``, reliability/accounting.py): every
request is accounted for exactly once (0 lost, duplicated or mismatched, apart from the requests
a kill strands: owed past ``execute``, at most ``max_owed_answers`` per killed instance);
innocent requests fail only in flight at a kill; bad inputs are
never answered with a success; at most 0.5 % of the answers come later than their deadline +
0.5 s beyond the client's own ingest; 0 whole-server restarts, and a reload after every kill.

The client's own ingest: before the load, the same clients (concurrency, protocols, families,
tensors) send for ``INGEST_S`` to models that answer at once (``echo_image``, ``echo_tokens``:
python models with each family's input, written beside the test repository). The p99 of what
they wait there, per protocol and family, is what sending, reading and Triton's front end take
with no model in the way; lateness is counted beyond it. It writes chaos.{json,csv,png,md} into ``--out``
(reliability/chaos_report.py), every request's outcome into ``--raw`` (git-ignored), and exits
non-zero unless the run was clean.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import output_arguments
from bls_models import spec as S
from modelgen import poison
from reliability import supervision
from reliability.accounting import BAD, KINDS, Chaos, Kill, Outcome, account
from reliability.chaos_report import report, shown
from tritonlocal import launcher, procs

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("pipeline", "tag_pipeline")            # the load, and the stubs that are killed
POISON_MODEL = "pipeline_poison_embedder"        # its embedder stage fails a poisoned batch
ECHO = {"pipeline": "echo_image", "tag_pipeline": "echo_tokens"}  # answer at once: the ingest
INGEST_S = 10.0
WATCHED = (*MODELS, POISON_MODEL)                # stubs whose memory is reported one by one
MIB = 2**20
RAMP_S = 5.0

# What callers use, wherever it is defined.
__all__ = ["BAD", "KINDS", "POISON_MODEL", "Chaos", "Inputs", "Kill", "Outcome", "Request", "account",
           "draw", "main", "report", "run", "shown"]


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


# -- the client's own ingest ------------------------------------------------------------------
ECHO_MODEL_PY = '''"""Answers every request at once (reliability.chaos: the client's own ingest)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "ECHO", np.zeros((len(pb_utils.get_input_tensor_by_name(r, name).as_numpy()), 1),
                             np.uint8))])
                for r in requests
                for name in [next(t.name() for t in r.inputs())]]
'''


def write_echo_models(target: Path) -> Path:
    """``echo_image`` and ``echo_tokens``: each family's orchestrator's input, batching and
    instances, answering at once."""
    from dataclasses import replace

    from modelgen import configs

    for family, name in ECHO.items():
        spec = S.PIPELINE if family == "pipeline" else S.TAG_PIPELINE
        echo = replace(spec, name=name, outputs=(S.TensorSpec("ECHO", "TYPE_UINT8", (1,)),),
                       parameters={}, orchestrates="", description="answers at once")
        (target / name / "1").mkdir(parents=True)
        (target / name / "config.pbtxt").write_text(configs.render(echo))
        (target / name / "1" / "model.py").write_text(ECHO_MODEL_PY)
    return target


async def ingest(server: launcher.TritonServer, concurrency: int, seconds: float,
                 tag_share: float, http_share: float, inputs: "Inputs") -> dict[str, dict]:
    """What the clients wait for models that answer at once, per "<protocol> <family>": p50, p99
    and the most, ms, and how many requests."""
    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http.aio as httpaio

    grpc = grpcaio.InferenceServerClient(server.grpc_url)
    http = httpaio.InferenceServerClient(server.http_url, conn_limit=concurrency)
    waited: dict[str, list[float]] = collections.defaultdict(list)
    stop_at = time.monotonic() + seconds
    tag_clients = round(concurrency * tag_share)
    http_every = max(1, round(1 / http_share)) if http_share > 0 else 0

    async def client(index: int) -> None:
        family = "tag_pipeline" if index < tag_clients else "pipeline"
        protocol = "http" if http_every and index % http_every == http_every - 1 else "grpc"
        name, dtype, data = inputs.good[family]
        module = grpcaio if protocol == "grpc" else httpaio
        await asyncio.sleep(RAMP_S * index / concurrency)
        while time.monotonic() < stop_at:
            tensor = module.InferInput(name, list(data.shape), dtype)
            tensor.set_data_from_numpy(data)
            began = time.monotonic()
            await (grpc if protocol == "grpc" else http).infer(ECHO[family], [tensor])
            waited[f"{protocol} {family}"].append(time.monotonic() - began)

    try:
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    finally:
        await grpc.close()
        await http.close()
    return {key: {"p50": float(np.percentile(v, 50) * 1e3), "p99": float(np.percentile(v, 99) * 1e3),
                  "max": float(max(v) * 1e3), "n": len(v)} for key, v in sorted(waited.items())}


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
async def run(server: launcher.TritonServer, supervisor: launcher.Supervisor, seconds: float,  # noqa: C901 - one timeline: load, kills, drain
              concurrency: int = 256, seed: int = 29, deadline_s: float = 10.0,
              grace_s: float = 30.0, kill_every: float = 90.0, tag_share: float = 0.125,
              http_share: float = 0.25, sample_every: float = 2.0, progress=print,
              outcomes: list[Outcome] | None = None, poison_mates: float = 0.5,
              ingest_s: float = INGEST_S) -> Chaos:
    """The chaos load against ``server`` (watched by ``supervisor``, already started) for
    ``seconds``, then every request still in flight awaited, the last reload waited for, and
    the accounting done. Each request's outcome is appended to ``outcomes`` if given. First, for
    ``ingest_s``, the clients' own ingest (the server must serve ``write_echo_models``' models;
    0: not measured, no allowance)."""
    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http.aio as httpaio
    from tritonclient.utils import InferenceServerException

    chaos = Chaos(seconds, concurrency, seed, deadline_s)
    inputs = Inputs()
    if ingest_s:
        progress(f"chaos: measuring the clients' own ingest for {ingest_s:.0f} s")
        chaos.ingest_ms = await ingest(server, concurrency, ingest_s, tag_share, http_share,
                                       inputs)
        progress("chaos: ingest p99 " + ", ".join(f"{k} {v['p99']:.0f} ms"
                                                  for k, v in chaos.ingest_ms.items()))
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
            supervision.reloaded(supervisor, kill.model, at) for kill, at in kills):
        await asyncio.sleep(0.2)
    if server.process is not None:
        chaos.samples.append({"seconds": round(time.monotonic() - started, 2),
                              "completed": len(outcomes),
                              **process_memory(server.process.pid, supervisor.reloader.retired)})
    account(chaos, outcomes, kills, supervisor, started)
    return chaos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability.chaos",
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
    output_arguments(parser, "where every request's outcome goes (git-ignored)")
    args = parser.parse_args(argv)
    command = "python -m reliability.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    seconds = args.seconds or (60.0 if args.quick else 1200.0)
    kill_every = args.kill_every or (60.0 if args.quick else 90.0)

    from bench import repository

    # The server's log is kept (.triton/, git-ignored) to explain a run that was not clean.
    log = ROOT / ".triton" / f"chaos-tritonserver-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory(prefix="chaos-") as scratch:
        variants = repository.build_test_repository(Path(scratch) / "variants",
                                                     args.model_repository)
        echo = write_echo_models(Path(scratch) / "echo")
        options = launcher.on_free_ports(args.model_repository, log, stop_grace=5.0,
                                         extra_args=[f"--model-repository={variants}",
                                                     f"--model-repository={echo}"])
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
    from bench.common import run_as_program

    run_as_program(main)
