"""A benchmark started as a program stops cleanly on SIGTERM as on Ctrl-C, also when started in
the background with SIGINT ignored (``bench.common.run_as_program``): its clean-up runs (the
``with`` blocks that stop its servers) and it exits with 128 + the signal's number."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = """
import time
from bench.common import run_as_program

def main():
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        time.sleep(0.3)  # a clean-up that takes a moment: a second signal must not cut it short
        print("cleaned up", flush=True)
    return 0

run_as_program(main)
"""


def ignore_sigint() -> None:
    """What a non-interactive shell does to a job it starts in the background."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_runs_the_clean_up_and_sets_the_exit_status(signum):
    process = subprocess.Popen([sys.executable, "-c", PROGRAM], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signum)
        time.sleep(0.1)
        process.send_signal(signum)  # a second one, during the clean-up
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert "cleaned up" in out, err
    assert process.returncode == 128 + signum, err
    assert f"stopped by {signum.name}" in err


# The programs that start servers or run long (benchmarks, operations, reliability, the ledger).
PROGRAMS = ("bench/*.py", "ops/*.py", "reliability/*.py", "tests/ledger.py")


def test_every_benchmark_program_runs_through_it():
    """Each module of ``PROGRAMS`` with a ``main`` runs it with ``run_as_program`` when
    started as a program (a test calling ``main`` installs no handler)."""
    missing = []
    for path in sorted(p for pattern in PROGRAMS for p in ROOT.glob(pattern)):
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        guarded = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if not any("run_as_program(main)" in ast.unparse(n) for n in guarded):
            missing.append(str(path.relative_to(ROOT)))
    assert missing == []
