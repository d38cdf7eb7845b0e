"""What every benchmark experiment shares: the ``Context`` it runs in, the ``Result`` it returns
(rows for the CSV, a markdown summary, the perf_analyzer command lines, a plot, JSON data), and
the summary's helpers.

Everything one experiment compares is measured in the same run, side by side, because the
machine is shared and noisy: ratios are meaningful, absolute numbers much less so.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import perf
from bench.perf import Point

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def run_as_program(main) -> None:
    """``sys.exit(main())`` for a benchmark started as a program, stopped cleanly by SIGTERM as by
    Ctrl-C: either raises KeyboardInterrupt in the main thread, so the ``with`` blocks of its
    servers exit (tritonserver stopped, its stubs with it) and its supervisors stop. SIGINT gets
    the handler explicitly: a process a non-interactive shell starts in the background inherits
    it ignored. Later signals are ignored, so they do not cut the clean-up short. Exit status
    128 + the signal's number."""
    received: list[int] = []

    def interrupt(signum, frame):
        received.append(signum)
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    try:
        code = main()
    except KeyboardInterrupt:
        signum = received[0] if received else signal.SIGINT
        print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        code = 128 + signum
    sys.exit(code)


def output_arguments(parser, raw_help: str) -> None:
    """A command's --out (the committed results), --raw (git-ignored: ``raw_help`` says what
    goes there) and --model-repository."""
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--raw", type=Path, default=RESULTS / "raw", help=raw_help)
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")


@dataclass
class Context:
    server: object            # tritonlocal.TritonServer, serving the repository + variants
    repository: Path
    settings: perf.Settings

    @property
    def quick(self) -> bool:
        return self.settings.quick


@dataclass
class Result:
    name: str
    title: str
    rows: list[dict] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)   # markdown lines
    commands: list[str] = field(default_factory=list)
    plot: dict | None = None                            # {"kind": ..., "series": ...}
    # More plots an experiment draws itself: suffix -> (title, draw(path)), written as
    # <name>-<suffix>.png.
    figures: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)            # machine-readable outcome (JSON)

    def add(self, variant: str, point: Point, protocol: str = "grpc", errors: int = 0, **extra):
        self.rows.append({"experiment": self.name, "variant": variant, "protocol": protocol,
                          **dataclasses.asdict(point), "errors": errors, **extra})

    def add_run(self, variant: str, run: perf.Run, protocol: str = "grpc", **extra) -> list[Point]:
        self.commands.append(run.command_line)
        if run.error:
            self.summary.append(f"- **{variant}: perf_analyzer failed**: {run.error}")
        for concurrency, reason in run.retried:
            self.summary.append(f"- {variant}: the first perf_analyzer attempt at concurrency "
                                f"{concurrency} did not complete ({reason}); the retry did")
        for p in run.points:
            self.add(variant, p, protocol, **extra)
        return run.points


def best_point(points: list[Point]) -> Point | None:
    """The point of highest throughput."""
    return max(points, key=lambda p: p.throughput) if points else None


def point_at(points: list[Point], concurrency: int) -> Point | None:
    return next((p for p in points if p.concurrency == concurrency), None)


def ratio_text(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def target_line(label: str, value: float | None, limit: float, better: str, unit: str = "") -> str:
    """A summary line: ``value`` against its target ``limit`` (``better``: "higher" or "lower"),
    met or missed by how much."""
    if value is None:
        return f"- {label}: not measured"
    met = value >= limit if better == "higher" else value <= limit
    return (f"- {label}: **{value:.2f}{unit}** (target {'≥' if better == 'higher' else '≤'} "
            f"{limit}{unit}) — " + ("met" if met else f"**missed** by {abs(value - limit):.2f}{unit}"))
