"""`make tune`'s smoke test: Triton Model Analyzer, as `ops.tune` runs it, profiles a stage
model over a minimal space against the project's own tritonserver and backends, and writes the
summary, the per-variant table and its own report."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys

import pytest

from bls_models import spec as S
from ops import tune

MODEL = S.DIGITS_SMALL.name  # microseconds a row: the measurements take seconds


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    if not (tune.MA_VENV / "bin" / "model-analyzer").exists():
        pytest.fail("Model Analyzer is not installed: `make test` installs it (.venv-tune)")
    out, raw = tmp_path_factory.mktemp("tuning"), tmp_path_factory.mktemp("raw")
    before = snapshot()
    done = subprocess.run([sys.executable, "-m", "ops.tune", "--model", MODEL, "--smoke",
                           "--out", str(out), "--raw", str(raw)], cwd=tune.ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, raw, done.stdout, before, snapshot()


def snapshot() -> dict[str, tuple[int, int]]:
    """Every file of the project's repository: (size, modification time)."""
    repository = tune.ROOT / "model_repository"
    return {str(p.relative_to(repository)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in repository.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_model_analyzer_profiles_two_configurations_and_reports_them(tuned):
    out, _, stdout, _, _ = tuned
    with (out / f"{MODEL}.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    measured = {row["variant"] for row in rows if float(row["throughput_infer_per_s"]) > 0}
    assert f"{MODEL}_config_default" in measured  # the committed config, in the same run
    assert len(measured) >= 2, rows
    # The smoke space is one instance and two: both were served and measured.
    assert {row["instance_count"] for row in rows} == {"1", "2"}
    summary = json.loads((out / "summary.json").read_text())
    result = summary["models"][MODEL]
    assert result["variants"] == len(measured)
    assert result["chosen"]["throughput"] > 0 and result["committed"]["throughput"] > 0
    text = (out / "SUMMARY.md").read_text()
    assert f"| {MODEL} |" in text
    assert (out / f"{MODEL}-report" / "result_summary.html").is_file()
    # A progress line per variant profiled.
    assert stdout.count("Profiling ") >= len(measured)


def test_model_analyzer_leaves_the_project_repository_as_it_was(tuned):
    """Model Analyzer serves the repository and loads its variants through the repository API;
    the variants it writes go to the run's own directory."""
    _, raw, _, before, after = tuned
    assert after == before
    (run,) = [p for p in raw.iterdir() if p.is_dir()]
    assert (run / MODEL / "variants" / f"{MODEL}_config_0" / "config.pbtxt").is_file()


def test_a_stopped_run_takes_model_analyzers_server_with_it(tmp_path):
    """SIGTERM while Model Analyzer profiles: the run ends, and no tritonserver or
    perf_analyzer it started is left behind."""
    raw = tmp_path / "raw"
    process = subprocess.Popen([sys.executable, "-m", "ops.tune", "--model", MODEL, "--smoke",
                                "--out", str(tmp_path / "out"), "--raw", str(raw)],
                               cwd=tune.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        for line in process.stdout:
            if "Profiling " in line:
                break
        else:
            pytest.fail("the run ended before profiling anything")
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        process.kill()
    assert process.returncode != 0
    left = tune.started_under(raw)  # by command line or working directory (perf_analyzer's)
    assert not left, left
