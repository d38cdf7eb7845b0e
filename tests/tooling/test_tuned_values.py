"""The committed configs carry the tuning sweep's winners (bench/results/tuning.json) and the
ONNX Runtime options that won `make bench-ort_options` (bench/results/ort_options.json).

Re-running `make bench-tuning` rewrites the winners; this test then fails until they are applied
in bls_models/spec.py (and `make configs`), so a config can always be traced to a measurement.
"""

import json
from pathlib import Path

import pytest

from bls_models import spec as S

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "tuning.json"


def _winners() -> dict:
    meta = json.loads(RESULTS.read_text())
    assert not meta["quick"], "bench/results/tuning.json holds a smoke run, not a measurement"
    return meta["data"]["winners"]


def test_the_sweep_found_winners():
    assert _winners(), "the committed tuning run chose no winner for any model"


@pytest.mark.parametrize("name", sorted(_winners()) if RESULTS.exists() else [])
def test_committed_config_is_the_winner(name):
    winner = _winners()[name]
    model = S.model(name)
    assert model.instance_count == winner["instance_count"]
    if model.backend == "onnxruntime":
        assert model.batching.max_queue_delay_us == winner["max_queue_delay_us"]
        assert list(model.batching.preferred_batch_sizes) == winner["preferred_batch_sizes"]


ORT_RESULTS = RESULTS.with_name("ort_options.json")


@pytest.mark.skipif(not ORT_RESULTS.exists(), reason="no committed ONNX Runtime options run")
def test_committed_onnx_runtime_parameters_are_the_measured_winner():
    meta = json.loads(ORT_RESULTS.read_text())
    assert not meta["quick"], "bench/results/ort_options.json holds a smoke run, not a measurement"
    winner = meta["data"]
    assert winner["parameters"] == S.ORT_CPU_PARAMETERS, winner["winner"]
    assert not winner["optimization"], "the winner sets a graph optimisation level the spec lacks"
    for model in S.ONNX_MODELS:
        assert model.parameters == S.ORT_CPU_PARAMETERS, model.name
