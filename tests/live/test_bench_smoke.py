"""Every benchmark experiment runs end to end on smoke settings (seconds; no thresholds), so the
benchmark code cannot rot. The real runs are `make bench`, never part of `make test`."""

from __future__ import annotations

import csv
import json

import pytest

from bench import perf, report
from bench.__main__ import EXPERIMENTS
from bench.common import Context, Result


@pytest.fixture(scope="module")
def context(server, repository):
    return Context(server, repository, perf.Settings(quick=True))


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_runs_and_writes_its_results(name, context, tmp_path):
    result = EXPERIMENTS[name](context)
    assert result.rows, result.summary
    failures = [line for line in result.summary if "perf_analyzer failed" in line]
    assert failures == []
    report.write(result, tmp_path, "2.51.0", context.settings)
    rows = list(csv.DictReader((tmp_path / f"{name}.csv").open()))
    measured = [r for r in rows if r.get("throughput")]  # not the anchor rounds' figures
    assert measured and all(float(r["throughput"]) > 0 for r in measured)
    assert json.loads((tmp_path / f"{name}.json").read_text())["quick"] is True
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    text = report.assemble(tmp_path).read_text()
    assert result.title in text and "quick smoke settings" in text


def test_the_gpu_checks_overhead_step_runs_without_an_in_process_comparison(context, server):
    """`make gpu-check` runs the overhead experiment on the GPU's server with no in-process run
    (ops/gpu_check.py, ``Check.perf``): the same code path, here on this server."""
    from bench import overhead

    result = Result("overhead", "")
    overhead.measure(context, result, server, None, [1], seconds=1.0)
    variants = {row["variant"] for row in result.rows}
    assert "in-process onnxruntime" not in variants
    assert {"BLS `pipeline`", "minimal per-batch BLS (anchor)", "`pipeline_ensemble`",
            "client calls sub-models"} <= variants
    assert not [line for line in result.summary if "perf_analyzer failed" in line]
    assert sum("(target " in line for line in result.summary) == 4, result.summary

