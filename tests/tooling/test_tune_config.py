"""What `make tune` asks of Model Analyzer, without running it: the search spaces and settings
of the CPU profile, and of the GPU profile (`BLS_PROFILE=gpu`, not executed here), as
`python -m ops.tune --dry-run` writes them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from bls_models import spec as S
from ops import tune


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def written(request, tmp_path_factory):
    raw = tmp_path_factory.mktemp(f"tune-{request.param}")
    models = ["classifier", "pipeline", "pipeline_ensemble", "digits_cascade", "tag_pipeline"]
    done = subprocess.run([sys.executable, "-m", "ops.tune", "--dry-run", "--profile",
                           request.param, "--raw", str(raw), *(f"--model={m}" for m in models)],
                          cwd=tune.ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (run,) = [p for p in raw.iterdir() if p.is_dir()]
    return request.param, {m: yaml.safe_load((run / m / "model-analyzer.yaml").read_text())
                           for m in models}


def test_a_stage_model_gets_a_brute_search_over_instances_and_delay(written):
    profile, configs = written
    config = configs["classifier"]
    assert config["run_config_search_disable"] is True
    spec = config["profile_models"]["classifier"]
    assert spec["cpu_only"] is (profile == "cpu")
    (group,) = spec["model_config_parameters"]["instance_group"]
    assert group == {"kind": "KIND_CPU" if profile == "cpu" else "KIND_GPU",
                     "count": list(tune.STAGE_INSTANCES)}
    batching = spec["model_config_parameters"]["dynamic_batching"]
    assert batching == {"max_queue_delay_microseconds": list(tune.STAGE_DELAYS_US)}
    assert tune.COMPARE_AT in spec["parameters"]["concurrency"]
    assert config["constraints"] == {"perf_latency_p99": {"max": tune.BUDGET_MS["stage"]}}
    # Model Analyzer never writes into the repository it is given.
    assert config["output_model_repository_path"] != config["model_repository"]


def test_a_bls_model_is_profiled_with_its_composing_models(written):
    profile, configs = written
    for name, composing in tune.BLS_COMPOSING.items():
        config = configs[name]
        assert config["run_config_search_mode"] == "quick"
        assert config["bls_composing_models"] == list(composing)
        assert config["profile_models"][name]["cpu_only"] is True  # KIND_CPU everywhere
        assert config.get("cpu_only_composing_models") == (
            list(composing) if profile == "cpu" else None)
        # No variant takes fewer rows than the orchestrator sizes its sub-requests for.
        assert config["run_config_search_min_model_batch_size"] == max(
            S.model(m).max_batch_size for m in (name, *composing))
    assert "TOKENS:" in configs["tag_pipeline"]["perf_analyzer_flags"]["shape"]
    assert configs["digits_cascade"]["perf_analyzer_flags"]["input-data"].endswith("digits.json")


def test_an_ensemble_is_profiled_with_its_steps(written):
    profile, configs = written
    config = configs["pipeline_ensemble"]
    assert "bls_composing_models" not in config
    steps = [step.model for step in S.PIPELINE_ENSEMBLE.ensemble_steps]
    assert config.get("cpu_only_composing_models") == (steps if profile == "cpu" else None)


def test_the_gpu_profile_tunes_the_rendered_gpu_repository(written):
    profile, configs = written
    repository = configs["classifier"]["model_repository"]
    assert repository.endswith("repository-gpu") == (profile == "gpu")


def test_a_users_own_bls_model_is_profiled_with_the_models_it_calls(tmp_path):
    """docs/extending.md's pipeline, in a user's checkout: `--composing NAME=A,B,C`."""
    from tests.helpers import EXTENDING_NAME, extending_checkout, page_model_py

    (tmp_path / "work").mkdir()
    repository = extending_checkout(tmp_path / "work", tune.ROOT / "model_repository",
                                    page_model_py())
    raw = tmp_path / "raw"
    composing = "preprocess,embedder,classifier"
    done = subprocess.run([sys.executable, "-m", "ops.tune", "--dry-run", "--raw", str(raw),
                           "--repository", str(repository),
                           "--composing", f"{EXTENDING_NAME}={composing}"],
                          cwd=tune.ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (run,) = [p for p in raw.iterdir() if p.is_dir()]
    config = yaml.safe_load((run / EXTENDING_NAME / "model-analyzer.yaml").read_text())
    assert config["model_repository"] == str(repository.resolve())
    assert config["bls_composing_models"] == composing.split(",")
    assert config["run_config_search_mode"] == "quick"
    assert config["run_config_search_min_model_batch_size"] == 16  # read from its config.pbtxt
