"""The committed configs carry what Triton Model Analyzer chose (`make tune`,
bench/results/tuning/summary.json) and the ONNX Runtime options that won `make bench-ort_options`
(bench/results/ort_options.json), which Model Analyzer does not search.

Re-running `make tune` rewrites the choices; this test then fails until they are applied in
bls_models/spec.py (and `make configs`), so a config can always be traced to a measurement.
"""

import json
from pathlib import Path

import pytest

from bls_models import spec as S
from ops import tune

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
SUMMARY = RESULTS / "tuning" / "summary.json"


def _tuned() -> dict:
    meta = json.loads(SUMMARY.read_text())
    assert not meta["smoke"], "bench/results/tuning/summary.json holds a smoke run, not a measurement"
    assert meta["profile"] == "cpu", "the committed configs are the CPU profile's"
    return meta["models"]


def test_model_analyzer_tuned_the_default_models():
    tuned = _tuned()
    assert set(tune.DEFAULT_MODELS) <= set(tuned)
    for name, result in tuned.items():
        assert result["committed"], f"{name}: the committed config was not measured"


STAGES = [name for name in tune.DEFAULT_MODELS if tune.kind(name) == "stage"]


@pytest.mark.parametrize("name", STAGES)
def test_a_stage_models_committed_config_is_model_analyzers_choice(name):
    result = _tuned()[name]
    chosen, model = result["chosen"], S.model(name)
    assert chosen, f"{name}: no variant within the budget; keep the committed config and say why"
    assert model.instance_count == chosen["instance_count"]
    assert model.batching.max_queue_delay_us == chosen["max_queue_delay_us"]
    # Not searched: the committed values, which every variant kept.
    assert model.max_batch_size == chosen["max_batch_size"]
    assert list(model.batching.preferred_batch_sizes) == chosen["preferred_batch_sizes"]


@pytest.mark.parametrize("name", STAGES)
def test_the_choice_is_no_slower_than_the_committed_config_at_the_compared_concurrency(name):
    result = _tuned()[name]
    assert result["chosen"]["concurrency"] == result["committed"]["concurrency"] == tune.COMPARE_AT
    assert result["chosen"]["p99_ms"] <= result["budget_p99_ms"]
    assert result["chosen"]["throughput"] >= result["committed"]["throughput"]


ORT_RESULTS = RESULTS / "ort_options.json"


@pytest.mark.skipif(not ORT_RESULTS.exists(), reason="no committed ONNX Runtime options run")
def test_committed_onnx_runtime_parameters_are_the_measured_winner():
    meta = json.loads(ORT_RESULTS.read_text())
    assert not meta["quick"], "bench/results/ort_options.json holds a smoke run, not a measurement"
    winner = meta["data"]
    assert winner["parameters"] == S.ORT_CPU_PARAMETERS, winner["winner"]
    assert not winner["optimization"], "the winner sets a graph optimisation level the spec lacks"
    for model in S.ONNX_MODELS:
        assert model.parameters == S.ORT_CPU_PARAMETERS, model.name
