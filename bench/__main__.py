"""`python -m bench` (`make bench`): start the local server through the launcher and run the
benchmark experiments with the real perf_analyzer and the project's own clients.

    python -m bench                         # every experiment
    python -m bench --experiment overhead   # one (or several) of them
    python -m bench --quick                 # seconds-long smoke run (used by the tests)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench import control_flow, orchestration, ort_options, overhead, perf, report, saturation
from bench.common import Context
from bench.repository import build_variants
from tritonlocal import TritonServer, on_free_ports

ROOT = Path(__file__).resolve().parents[1]
# The experiments by name: what `python -m bench --experiment NAME` (`make bench-NAME`) runs. Each
# takes a ``Context`` and returns a ``Result`` (bench/common.py); each lives in the module of its
# family.
EXPERIMENTS = {
    "orchestration": orchestration.orchestration,
    "overload": saturation.overload,
    "ort_options": ort_options.ort_options,
    "overhead": overhead.overhead,
    "control_flow": control_flow.control_flow,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", action="append", choices=list(EXPERIMENTS),
                        help="run only this experiment (repeatable; default: all)")
    parser.add_argument("--quick", action="store_true", help="smoke settings: seconds, no claims")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args(argv)
    names = args.experiment or list(EXPERIMENTS)
    settings = perf.Settings(quick=args.quick)
    report.started()  # the commit being measured, before anything can change the tree
    if not perf.PERF_ANALYZER.exists():
        print("perf_analyzer is not installed: run `make venv`", file=sys.stderr)
        return 2
    # The server's log outlives the run (.triton/, git-ignored): a server that dies mid-run
    # must be explainable afterwards.
    log = ROOT / ".triton" / f"bench-tritonserver-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        extra = build_variants(Path(tmp) / "variants", args.model_repository)
        options = on_free_ports(args.model_repository, log,
                                extra_args=[f"--model-repository={extra}"])
        with TritonServer(options) as server:
            version = server.metadata().get("version", "?")
            context = Context(server, args.model_repository, settings)
            print(f"server log: {log}", flush=True)
            for name in names:
                started = time.monotonic()
                print(f"== {name} ...", flush=True)
                try:
                    result = EXPERIMENTS[name](context)
                except Exception:
                    if not server.is_running():
                        print(f"tritonserver exited during '{name}' (code "
                              f"{server.process.returncode}); log {log}:\n{server.log_tail(60)}",
                              file=sys.stderr)
                    raise
                report.write(result, args.out, version, settings)
                print("\n".join(result.summary), flush=True)
                print(f"== {name}: {time.monotonic() - started:.0f} s", flush=True)
    path = report.assemble(args.out)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
