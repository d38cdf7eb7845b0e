"""`python -m reliability.recovery` (`make bench-recovery`): a python stub SIGKILLed under mixed load,
and what it costs each model.

    python -m reliability.recovery                  # 5 runs, each on a server of its own
    python -m reliability.recovery --runs 1 --victim tag_pipeline

Each run starts a server over the committed repository with the launcher's supervisor
(``tritonlocal.launcher.Supervisor``: it reloads a model whose stub died, alone). Clients load
`pipeline`, `tag_pipeline` and `pipeline_ensemble` at once, each model from its own gRPC clients
(one asyncio connection) and HTTP clients (threads), every request with a client deadline of
``--deadline-s`` (also its Triton timeout). After ``--before-s`` one stub of ``--victim`` is
SIGKILLed; the run goes on until the supervisor has brought the model back and ``--after-s``
more. A run reports:

- ``detected_s`` / ``reloaded_s``: from the kill to the supervisor's reload starting and to the
  new copy serving;
- ``answering_s``: from the kill to the end of the last failed request of the victim *sent after
  the kill* (0 if none failed): from then on every request to it succeeded;
- ``in_flight``: the victim's requests in flight at the kill that failed, and when the last was
  answered (``in_flight_answered_s``; the orchestrators answer every request before ``execute``
  returns, and r24.10 fails the requests of an ``execute`` its stub died in, so none should wait
  for the client's deadline);
- ``others_failed``: failed requests to the other models (the target is 0);
- ``server_restarts``: whole-server restarts (the target is 0; the fallback when a reload fails or
  the server died).

It writes ``recovery.csv`` (one row per run), ``recovery.json`` (every run with its events) and
``recovery.md`` into ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bls_models import spec as S
from reliability import supervision
from reliability.accounting import Kill
from tritonlocal import launcher, procs
from tritonlocal.load import Answer, closed_loop

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("pipeline", "tag_pipeline", "pipeline_ensemble")


def model_input(model: str) -> tuple[str, str, np.ndarray]:
    """(input name, datatype, one request's data) for a model of the mixed load."""
    if model == "tag_pipeline":
        rng = np.random.default_rng(7)
        return "TOKENS", "INT64", rng.integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN),
                                               dtype=np.int64)
    rng = np.random.default_rng(3)
    return "IMAGE", "UINT8", rng.integers(0, 256, (1, *S.IMAGE.dims), dtype=np.uint8)


def http_loop(url: str, model: str, stop: threading.Event, deadline: float,
              answers: list[Answer], index: int) -> None:
    """One HTTP client sending ``model`` requests back to back until ``stop``, each with a
    ``deadline`` (client timeout and Triton timeout); 50 ms pause after an error."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    name, dtype, data = model_input(model)
    client = httpclient.InferenceServerClient(url, network_timeout=deadline,
                                              connection_timeout=deadline)
    sequence = 0
    try:
        while not stop.is_set():
            tensor = httpclient.InferInput(name, list(data.shape), dtype)
            tensor.set_data_from_numpy(data)
            sent_id, started = f"{model}-http{index}-{sequence}", time.monotonic()
            sequence += 1
            try:
                result = client.infer(model, [tensor], request_id=sent_id,
                                      timeout=int(deadline * 1e6))
                answers.append(Answer(started, time.monotonic(), sent_id,
                                      result.get_response().get("id"), None))
                continue
            except InferenceServerException as error:
                code, message = f"HTTP {error.status()}", error.message() or ""
            except Exception as error:  # noqa: BLE001 - the client's own timeout, a reset
                code, message = type(error).__name__, str(error)
                client.close()
                client = httpclient.InferenceServerClient(url, network_timeout=deadline,
                                                          connection_timeout=deadline)
            answers.append(Answer(started, time.monotonic(), sent_id, None, code, message))
            time.sleep(0.05)
    finally:
        client.close()


@dataclass
class Run:
    """One run's figures (see the module's docstring), by what they are about."""

    victim: str
    victim_pid: int
    instance: str
    # The reload, and the server after it.
    detected_s: float | None = None
    reloaded_s: float | None = None
    server_restarts: int = 0
    stubs_all_new: bool = False
    alive_after: bool = False
    # The victim's requests: those in flight at the kill, then those sent after it.
    in_flight_failed: int = 0
    in_flight_answered_s: float = 0.0
    answering_s: float | None = None
    victim_failed_after_kill: int = 0
    victim_requests: int = 0
    # The other models' requests.
    others_requests: int = 0
    others_failed: int = 0
    failures: dict[str, dict[str, int]] = field(default_factory=dict)   # model -> code -> count
    events: list[str] = field(default_factory=list)


def kill_under_load(server: launcher.TritonServer, supervisor: launcher.Supervisor,
                    victim: str = "pipeline", before: float = 3.0, after: float = 5.0,
                    deadline: float = 3.0, grpc_clients: int = 2, http_clients: int = 1,
                    wait_retired: bool = True, others_deadline: float | None = None
                    ) -> tuple[Run, dict[str, list[Answer]]]:
    """Load every model of MODELS, SIGKILL one stub of ``victim``, wait for the supervisor to
    bring it back, and account for every request. Every request has a client deadline of
    ``deadline`` seconds, those to the other models ``others_deadline`` if given (a long one
    tells an error from a busy host's slowness). Returns the run and the answers per model."""
    stop = threading.Event()
    answers: dict[str, list[Answer]] = {m: [] for m in MODELS}
    threads = []
    for model in MODELS:
        name, dtype, data = model_input(model)
        limit = deadline if model == victim or others_deadline is None else others_deadline
        threads.append(threading.Thread(
            target=lambda m=model, n=name, d=dtype, x=data, t=limit: asyncio.run(
                closed_loop(server.grpc_url, m, grpc_clients, x, stop, name=n, dtype=d,
                            timeout_us=int(t * 1e6), retry_pause=0.05, answers=answers[m],
                            client_timeout=t)), name=f"grpc-{model}"))
        threads += [threading.Thread(target=http_loop, name=f"http-{model}-{i}",
                                     args=(server.http_url, model, stop, limit, answers[model], i))
                    for i in range(http_clients)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(before)
        stubs_before = set(server.stub_pids(victim))
        victim_pid = min(stubs_before)
        instance = procs.process(victim_pid).stub.instance
        killed_at = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        run = Run(victim, victim_pid, instance)
        limit = killed_at + 60.0
        while time.monotonic() < limit:
            done = supervision.reloaded(supervisor, victim, killed_at)
            ready = [t for t, what in supervisor.events if what == "ready" and t > killed_at]
            if done is not None or ready or supervisor.error:
                break
            time.sleep(0.05)
        time.sleep(after)
    finally:
        stop.set()
        for thread in threads:
            thread.join(max(deadline, others_deadline or 0) + 30)
    run.events = supervision.timeline(supervisor, killed_at, since=killed_at - 1)
    kill = Kill(victim, victim_pid, at_s=before)
    kill.follow(supervisor, killed_at)
    run.detected_s, run.reloaded_s = kill.detected_s, kill.reloaded_s
    run.server_restarts = supervision.server_restarts(supervisor)
    mine = answers[victim]
    run.victim_requests = len(mine)
    after_kill = [a for a in mine if a.started >= killed_at and a.code is not None]
    run.victim_failed_after_kill = len(after_kill)
    run.answering_s = round(max((a.finished for a in after_kill), default=killed_at) - killed_at, 3)
    in_flight = [a for a in mine if a.started < killed_at <= a.finished and a.code is not None]
    run.in_flight_failed = len(in_flight)
    run.in_flight_answered_s = round(max((a.finished for a in in_flight), default=killed_at)
                                     - killed_at, 3)
    for model, got in answers.items():
        codes: dict[str, int] = {}
        for a in got:
            if a.code is not None:
                codes[a.code] = codes.get(a.code, 0) + 1
        if codes:
            run.failures[model] = codes
        if model != victim:
            run.others_requests += len(got)
            run.others_failed += sum(codes.values())
    if wait_retired:  # the replaced copy's live stubs stop once their longest deadline is over
        until = max((entry.due for entry in supervisor.reloader.to_kill),
                    default=time.monotonic()) + 5
        while supervisor.reloader.to_kill and time.monotonic() < until:
            time.sleep(0.2)
        time.sleep(supervisor.interval * 2)
    # The stubs that serve the victim now (the replaced copy's, retired, may still be alive).
    now = set(server.stub_pids(victim)) - supervisor.reloader.retired
    run.stubs_all_new = bool(now) and not (now & stubs_before)
    run.alive_after = server.liveness(retired=supervisor.reloader.retired).ok
    return run, answers


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(runs: list[Run], command: str) -> str:
    lines = [f"# A `{runs[0].victim}` stub SIGKILLed under mixed load ({len(runs)} runs)", "",
             f"Command: `{command}`; {time.strftime('%Y-%m-%d %H:%M')} on this host "
             f"({os.cpu_count()} cores).", "",
             "| run | detected (s) | reloaded (s) | answering again (s) | in flight failed | "
             "last in-flight answer (s) | other models: requests / failed | server restarts | "
             "stubs all new | alive after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r.detected_s} | {r.reloaded_s} | {r.answering_s} | "
                     f"{r.in_flight_failed} | {r.in_flight_answered_s} | {r.others_requests} / "
                     f"{r.others_failed} | {r.server_restarts} | {r.stubs_all_new} | {r.alive_after} |")
    answering = [r.answering_s for r in runs if r.answering_s is not None]
    if answering:
        lines += ["", f"Answering again: p50 {statistics.median(answering):.2f} s, max "
                      f"{max(answering):.2f} s. Other models: "
                      f"{sum(r.others_failed for r in runs)} failed of "
                      f"{sum(r.others_requests for r in runs)}. Whole-server restarts: "
                      f"{sum(r.server_restarts for r in runs)}."]
    lines += ["", "Failures by model and status, per run:", ""]
    lines += [f"- run {i}: {json.dumps(r.failures)}" for i, r in enumerate(runs, 1)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability.recovery",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--victim", default="pipeline", choices=("pipeline", "tag_pipeline"))
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--before-s", type=float, default=3.0)
    parser.add_argument("--after-s", type=float, default=5.0)
    parser.add_argument("--deadline-s", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--no-wait-retired", action="store_true",
                        help="do not wait for the replaced copy's stubs to be retired (up to "
                        "max_deadline_ms after the reload): smoke runs")
    args = parser.parse_args(argv)
    command = "python -m reliability.recovery " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="recovery-") as scratch:
            options = launcher.on_free_ports(args.model_repository, Path(scratch) / "server.log",
                                             stop_grace=5.0)
            with launcher.TritonServer(options) as server:
                supervisor = launcher.Supervisor(server, retire_grace=5.0,
                                                 log=lambda line: print(f"  {line}", flush=True))
                supervisor.start()
                try:
                    run, _ = kill_under_load(server, supervisor, args.victim, args.before_s,
                                             args.after_s, args.deadline_s,
                                             wait_retired=not args.no_wait_retired)
                finally:
                    supervisor.stop()
        runs.append(run)
        print(f"run {index + 1}: detected {run.detected_s} s, reloaded {run.reloaded_s} s, "
              f"answering again {run.answering_s} s, in flight failed {run.in_flight_failed} "
              f"(last {run.in_flight_answered_s} s), other models failed {run.others_failed}/"
              f"{run.others_requests}, restarts {run.server_restarts}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "recovery.csv", "w", newline="") as handle:
        columns = [k for k in asdict(runs[0]) if k not in ("failures", "events")]
        writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for run in runs:
            writer.writerow({k: v for k, v in asdict(run).items() if k in columns})
    (args.out / "recovery.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    text = report(runs, command)
    (args.out / "recovery.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
