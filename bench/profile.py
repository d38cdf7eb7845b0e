"""Where a model's time goes: py-spy samples of its python-backend stubs under perf_analyzer load,
next to Triton's own per-model breakdown (queue, compute input/infer/output) of every model the
request touched.

    python -m bench.profile tag_pipeline --stubs tag_pipeline,tagger
    python -m bench.profile pipeline --concurrency 16 --stubs pipeline

Writes ``bench/results/profile-<model>.md`` (the top functions by own time and by inclusive
time, per stub) and py-spy's raw collapsed stacks (``profile-<model>-<stub>-<pid>.txt``,
flamegraph.pl input) into ``--raw`` (``bench/results/raw/``, git-ignored), which the report names
but does not link. Everything runs on the CPU of the machine it measures: py-spy's sampling costs
a few percent, so read shares, not absolute times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench import perf
from bench.common import output_arguments
from bls_models import spec as S
from tritonlocal import TritonServer, on_free_ports, procs
from tritonlocal.launcher import group_stubs

ROOT = Path(__file__).resolve().parents[1]
PY_SPY = Path(sys.executable).parent / "py-spy"


def collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output: one ``frame;frame;...;frame count`` line per distinct stack."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def top_functions(stacks: list[tuple[list[str], int]], n: int = 15) -> tuple[list, list, int]:
    """(own time, inclusive time, total samples): function -> samples, most first."""
    own, inclusive = collections.Counter(), collections.Counter()
    total = 0
    for frames, count in stacks:
        total += count
        own[_short(frames[-1])] += count
        for frame in set(_short(f) for f in frames):
            inclusive[frame] += count
    return own.most_common(n), inclusive.most_common(n), total


def _short(frame: str) -> str:
    """``function (path/to/file.py:line)`` -> ``function (file.py)``: lines split one function."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({file})" if file else name


def model_stats(server: TritonServer) -> dict[str, dict]:
    """Triton's cumulative per-model statistics (HTTP /v2/models/stats)."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/stats", timeout=10) as reply:
        stats = json.load(reply)["model_stats"]
    out = {}
    for entry in stats:
        infer = entry["inference_stats"]
        out[entry["name"]] = {"count": int(infer["success"]["count"]),
                              "executions": int(entry["execution_count"]),
                              **{k: int(infer[k]["ns"]) for k in
                                 ("queue", "compute_input", "compute_infer", "compute_output")}}
    return out


def server_processes(server_pid: int) -> dict[str, list[int]]:
    """The processes of a server's group by label: ``tritonserver`` and ``<model> stubs``."""
    return {"tritonserver": [server_pid],
            **{f"{model} stubs": pids for model, pids in group_stubs(server_pid).items()}}


def cpu_seconds(server: TritonServer, others: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system, seconds) so far of the server, of each model's stubs (summed per
    model) and of ``others`` (label -> pid, e.g. the load generator)."""
    out = {label: sum(procs.cpu_seconds(pid) for pid in pids)
           for label, pids in server_processes(server.process.pid).items()}
    for label, pid in others.items():
        out[label] = out.get(label, 0.0) + procs.cpu_seconds(pid)
    return out


def cpu_table(measured: "Load") -> list[str]:
    used, seconds, requests = measured.cpu, measured.seconds, measured.requests
    total = sum(used.values())
    lines = [f"{total / seconds:.2f} of the machine's {os.cpu_count()} cores were busy in these "
             f"processes ({requests} requests: {1000 * total / max(requests, 1):.1f} ms of CPU "
             "per request).", "", "| process | cores busy | share | CPU ms per request |",
             "|---|---|---|---|"]
    for name, value in sorted(used.items(), key=lambda kv: -kv[1]):
        if value > 0:
            lines.append(f"| {name} | {value / seconds:.2f} | {100 * value / total:.0f} % | "
                         f"{1000 * value / max(requests, 1):.2f} |")
    return lines


def breakdown(before: dict, after: dict) -> list[str]:
    lines = ["| model | requests | queue (ms) | compute input (ms) | compute infer (ms) | "
             "compute output (ms) |", "|---|---|---|---|---|---|"]
    for name, stats in after.items():
        earlier = before.get(name, {})
        count = stats["count"] - earlier.get("count", 0)
        if count <= 0:
            continue
        per_request = {key: f"{(stats[key] - earlier.get(key, 0)) / count / 1e6:.2f}"
                       for key in ("queue", "compute_input", "compute_infer", "compute_output")}
        lines.append(f"| {name} | {count} | {per_request['queue']} | "
                     f"{per_request['compute_input']} | {per_request['compute_infer']} | "
                     f"{per_request['compute_output']} |")
    return lines


def shown_path(path: Path, out: Path) -> str:
    """``path`` as the report names it: relative to the report's directory when inside it."""
    try:
        return str(path.resolve().relative_to(out.resolve()))
    except ValueError:
        return str(path)


@dataclass
class Load:
    """What happened while perf_analyzer drove one model for a fixed period."""

    cpu: dict[str, float]      # label -> CPU seconds used over the period
    requests: int              # requests the driven model completed over the period
    seconds: float
    stats_before: dict
    stats_after: dict

    def cpu_ms_per_request(self) -> dict[str, float]:
        return {k: 1000 * v / max(self.requests, 1) for k, v in self.cpu.items()}


def drive(server: TritonServer, model: str, concurrency: int, seconds: float,
          input_data: str = "zero", during=None, warmup: float = 5.0, tail: float = 5.0) -> Load:
    """Drive ``model`` with perf_analyzer at ``concurrency``; after ``warmup`` seconds, account
    for ``seconds`` of it (CPU of every process, Triton's per-model statistics). ``during()``, if
    given, runs in the measured period instead of a sleep (py-spy samplers wait there).

    perf_analyzer's one window ends ``tail`` seconds after the accounted period and it is left
    to finish on its own: killing it with requests in flight makes the server cancel them, and
    a gRPC cancellation racing a response can crash Triton 2.51 (a full benchmark run lost its
    server right after such a kill; upstream server#7368, #8034). Smoke runs shorten it."""
    load = subprocess.Popen(
        [str(perf.PERF_ANALYZER), "-m", model, "-i", "grpc", "-u", server.grpc_url,
         "--input-data", input_data, "--concurrency-range", f"{concurrency}:{concurrency}",
         "--measurement-interval", str(int(1000 * (seconds + warmup + tail))),
         "--stability-percentage", "1000", "--max-trials", "1",
         # tag_pipeline takes documents of any length: 512-token ones, as the tagger's window.
         *(["--shape", f"TOKENS:{S.TAGGER_SEQ_LEN}"] if model.startswith("tag_pipeline") else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(warmup)
        before = model_stats(server)
        cpu_before = cpu_seconds(server, {"perf_analyzer (client)": load.pid})
        started = time.monotonic()
        if during is None:
            time.sleep(seconds)
        else:
            during()
        after = model_stats(server)
        cpu_after = cpu_seconds(server, {"perf_analyzer (client)": load.pid})
        elapsed = time.monotonic() - started
    finally:
        try:
            load.communicate(timeout=tail + 60)
        except subprocess.TimeoutExpired:  # should not happen; then there is no choice
            load.terminate()
            load.communicate(timeout=30)
    used = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
    requests = (after.get(model, {}).get("count", 0) - before.get(model, {}).get("count", 0))
    return Load({k: v for k, v in used.items() if v > 0}, requests, elapsed, before, after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the model perf_analyzer drives")
    parser.add_argument("--stubs", default="", help="comma-separated models whose stubs to sample "
                        "(default: the driven model; `none`: CPU accounting only, no py-spy)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--input-data", default="zero")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames)")
    parser.add_argument("--gil", action="store_true",
                        help="py-spy --gil: only samples of the thread holding the GIL (the "
                             "stub's own Python CPU; waits on locks and IPC are left out)")
    output_arguments(parser, "where py-spy's collapsed stacks go (git-ignored)")
    args = parser.parse_args(argv)
    stubs = [] if args.stubs == "none" else [s for s in args.stubs.split(",") if s] or [args.model]
    if stubs and not PY_SPY.exists():
        print("py-spy is not installed: `.venv/bin/pip install py-spy` (or --stubs none)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.raw.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        with TritonServer(on_free_ports(args.model_repository,
                                        Path(tmp) / "tritonserver.log")) as server:
            samplers = {}

            def sample() -> None:
                for stub in stubs:
                    for pid in server.stub_pids(stub):
                        raw = args.raw / f"profile-{args.model}-{stub}-{pid}.txt"
                        # --native needs the stub stopped while it reads native stacks.
                        mode = ["--native"] if args.native else ["--nonblocking"]
                        mode += ["--gil"] if args.gil else []
                        samplers[(stub, pid)] = (raw, subprocess.Popen(
                            [str(PY_SPY), "record", "--pid", str(pid), "--duration",
                             str(args.seconds), "--rate", str(args.rate), "--format", "raw",
                             *mode, "--output", str(raw)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                if not samplers:
                    time.sleep(args.seconds)
                for _, sampler in samplers.values():
                    sampler.wait(timeout=args.seconds + 60)

            measured = drive(server, args.model, args.concurrency, args.seconds,
                             args.input_data, during=sample)
    report = [f"# Profile of `{args.model}` at concurrency {args.concurrency}", "",
              f"`python -m bench.profile {' '.join(argv if argv is not None else sys.argv[1:])}`: "
              f"perf_analyzer (gRPC, `--input-data {args.input_data}`) drives the model; "
              + (f"py-spy samples each stub for {args.seconds} s at {args.rate} Hz; idle threads are "
                 "left out, so the shares are of the stub's busy time." if stubs else
                 f"CPU and Triton's statistics are accounted over {args.seconds} s (no py-spy)."),
              "",
              "## Where the CPU went over the sampled period", "",
              *cpu_table(measured), "",
              "(py-spy's own sampling is not included; it runs beside these processes.)", "",
              "## Triton's per-model breakdown over the sampled period", "",
              "Per request, averaged; a batched execution counts its whole duration for each "
              "request in the batch.", "",
              *breakdown(measured.stats_before, measured.stats_after), ""]
    for (stub, pid), (raw, _) in samplers.items():
        if not raw.exists():
            report += [f"## `{stub}` stub {pid}: py-spy wrote nothing", ""]
            continue
        own, inclusive, total = top_functions(collapsed(raw))
        report += [f"## `{stub}` stub (pid {pid}): {total} samples, all threads "
                   f"(collapsed stacks: `{shown_path(raw, args.out)}`, not committed)", "",
                   "| own time | function | | inclusive | function |", "|---|---|---|---|---|"]
        for (f_own, n_own), (f_inc, n_inc) in zip(own, inclusive):
            report.append(f"| {100 * n_own / total:.1f} % | `{f_own}` | | "
                          f"{100 * n_inc / total:.1f} % | `{f_inc}` |")
        report.append("")
    path = args.out / f"profile-{args.model}.md"
    path.write_text("\n".join(report) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
