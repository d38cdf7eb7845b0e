"""Run the real perf_analyzer and read its CSV (``-f``) into rows of plain numbers.

perf_analyzer writes latencies in microseconds and sorts CSV rows by throughput; rows here come
back sorted by concurrency, with latencies in milliseconds. It prints everything on stderr.
"""

from __future__ import annotations

import csv
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonlocal.flags import REDACTED

PERF_ANALYZER = Path(sys.executable).parent / "perf_analyzer"


# Smoke settings: windows of 0.5 s (perf_analyzer's count windows last 1 s at the least, 3 s
# a level) and more trials than the 3 stable windows needed: the first window of a freshly
# loaded model includes ONNX Runtime's first runs, which made a 1-instance classifier miss even
# a 1000 % criterion within 3 (seen in CI).
QUICK_WINDOWS = ["--measurement-interval", "500", "--stability-percentage", "1000",
                 "--max-trials", "8"]


@dataclass
class Settings:
    """How long and how carefully to measure. ``quick`` is for smoke tests (seconds, no claims)."""

    window_ms: int = 3000
    # perf_analyzer's default is 10 %; with the client on the same 2 cores the ensemble at
    # concurrency 32 did not settle within 10 trials at 10 % (measured), so allow 15 % and more
    # trials. The report states the setting.
    stability: int = 15
    max_trials: int = 15
    percentile: int = 95
    quick: bool = False

    def flags(self) -> list[str]:
        if self.quick:
            return [*QUICK_WINDOWS, f"--percentile={self.percentile}"]
        return ["--measurement-interval", str(self.window_ms),
                "--stability-percentage", str(self.stability), "--max-trials", str(self.max_trials),
                f"--percentile={self.percentile}"]


@dataclass
class Point:
    concurrency: int
    throughput: float                     # inferences/s
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    server_queue_ms: float
    server_compute_ms: float
    client_send_recv_ms: float


def point(concurrency: int, latencies: list[float], wall: float) -> Point:
    """A row like perf_analyzer's from latencies (seconds) measured by the project's own load
    generators over ``wall`` seconds; no server-side figures."""
    ms = np.array(latencies) * 1e3 if latencies else np.array([np.nan])
    return Point(concurrency=concurrency, throughput=len(latencies) / wall if wall else 0.0,
                 p50_ms=float(np.percentile(ms, 50)), p90_ms=float(np.percentile(ms, 90)),
                 p95_ms=float(np.percentile(ms, 95)), p99_ms=float(np.percentile(ms, 99)),
                 server_queue_ms=0.0, server_compute_ms=0.0, client_send_recv_ms=0.0)


@dataclass
class Run:
    command: list[str]
    points: list[Point] = field(default_factory=list)
    error: str = ""
    # Levels whose first attempt failed and whose second succeeded: (concurrency, first error).
    retried: list[tuple[int, str]] = field(default_factory=list)

    @property
    def command_line(self) -> str:
        """The command as reports print it, the same in every run: the value of every ``-H``
        header (the admin credential) redacted, the CSV file (``-f``, in a temporary
        directory) by its name, the server's port (``-u``, a free one per run) as ``<port>``.
        What runs is ``command``."""
        shown = []
        for before, arg in zip(["", *self.command], self.command):
            if before == "-H":
                arg = f"{arg.split(':', 1)[0]}: {REDACTED}"
            elif before == "-f":
                arg = Path(arg).name
            elif before == "-u":
                arg = re.sub(r":\d+$", ":<port>", arg)
            shown.append(arg)
        return shlex.join(["perf_analyzer", *shown[1:]])


def run(model: str, url: str, concurrency: list[int], settings: Settings, *,
        protocol: str = "grpc", extra: list[str] | None = None, timeout: float = 1800) -> Run:
    """perf_analyzer over ``concurrency`` (each value measured, in order)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.csv"
        command = [str(PERF_ANALYZER), "-m", model, "-i", protocol, "-u", url,
                   *settings.flags(), "-f", str(report), *(extra or [])]
        result = Run(command)
        for value in concurrency:
            one = [*command, "--concurrency-range", f"{value}:{value}"]
            # One retry: on this shared 2-core host a level's windows occasionally never settle
            # (seen once in ~10 CI runs of the quick tuning sweep); the retry is reported.
            reasons = []
            for _ in range(2):
                completed = subprocess.run(one, capture_output=True, text=True, timeout=timeout)
                output = completed.stdout + completed.stderr
                if completed.returncode == 0 and report.exists():
                    break
                reasons.append(output.strip().splitlines()[-1] if output.strip() else "no output")
            if completed.returncode != 0 or not report.exists():
                # Record it and go on: one unstable level must not hide the others.
                result.error += ("; " if result.error else "") + (
                    f"{reasons[-1]} (concurrency {value}, twice)")
                continue
            if reasons:
                result.retried.append((value, reasons[0]))
            result.points += read_csv(report)
            report.unlink()
        result.command = [*command, "--concurrency-range", ",".join(map(str, concurrency))]
        result.points.sort(key=lambda p: p.concurrency)
        return result


def interleaved(models: dict[str, str], url: str, levels: list[int], settings: Settings
                ) -> dict[str, Run]:
    """``run`` over ``levels`` for each of ``models`` (key -> model), level by level, one model
    after the other at each level (in reverse order every other level): a slow spell of the
    shared host hits every model alike."""
    runs: dict[str, Run] = {}
    for index, level in enumerate(levels):
        for key, model in (list(models.items()) if index % 2 == 0
                           else list(models.items())[::-1]):
            one = run(model, url, [level], settings)
            if key not in runs:
                runs[key] = one
                continue
            combined = runs[key]
            combined.points += one.points
            combined.error += ("; " if combined.error and one.error else "") + one.error
            combined.retried += one.retried
            combined.command = [*combined.command[:-1], f"{combined.command[-1]},{level}"]
    return runs


def p50_at_1(server, model: str, quick: bool = False) -> int | None:
    """perf_analyzer's p50 (µs) at concurrency 1 over gRPC, against ``server`` (a
    tritonlocal.TritonServer). ``quick``: smoke settings (``QUICK_WINDOWS``)."""
    windows = QUICK_WINDOWS if quick else ["--measurement-interval", "3000"]
    out = subprocess.run([str(PERF_ANALYZER), "-m", model, "-i", "grpc", "-u",
                          server.grpc_url, "--concurrency-range", "1:1", *windows,
                          "--percentile=50"],
                         capture_output=True, text=True, check=False).stdout
    found = re.search(r"p50 latency: (\d+) usec", out)
    return int(found.group(1)) if found else None


def read_csv(path: Path) -> list[Point]:
    points = []
    with path.open() as handle:
        for row in csv.DictReader(handle):
            us = {k: float(v) for k, v in row.items() if k and v not in ("", None)
                  and k != "Concurrency" and _is_number(v)}
            points.append(Point(
                concurrency=int(float(row["Concurrency"])),
                throughput=float(row["Inferences/Second"]),
                p50_ms=us.get("p50 latency", 0) / 1e3, p90_ms=us.get("p90 latency", 0) / 1e3,
                p95_ms=us.get("p95 latency", 0) / 1e3, p99_ms=us.get("p99 latency", 0) / 1e3,
                server_queue_ms=us.get("Server Queue", 0) / 1e3,
                server_compute_ms=(us.get("Server Compute Input", 0) + us.get("Server Compute Infer", 0)
                                   + us.get("Server Compute Output", 0)) / 1e3,
                client_send_recv_ms=(us.get("Client Send", 0) + us.get("Client Recv", 0)
                                     + us.get("Network+Server Send/Recv", 0)) / 1e3,
            ))
    return points


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
