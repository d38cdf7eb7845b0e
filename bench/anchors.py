"""What the runtime is measured against: ``pipeline_minimal`` (``bench/models/minimal.py``), the
plainest per-batch BLS, the anchor of the overhead and orchestration experiments.

It is not part of the production repository; ``write`` renders it into a benchmark or test
repository with ``pipeline``'s contract and batching.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from bls_models import spec as S
from modelgen import configs

MODELS = Path(__file__).resolve().parent / "models"
# ``profile.drive``'s warm-up and tail on smoke settings: seconds of waiting, no claims.
QUICK_DRIVE = {"warmup": 0.5, "tail": 1.0}
MINIMAL = MODELS / "minimal.py"


def write(target: Path, repository: Path) -> None:
    """The anchor as ``pipeline_minimal`` in ``target``, with ``pipeline``'s contract, batching
    and parameters, over the stage models of ``repository``."""
    spec = dataclasses.replace(S.PIPELINE, name="pipeline_minimal", parameters={
        **S.PIPELINE.parameters, "stage_model_repositories": str(repository)})
    (target / spec.name / "1").mkdir(parents=True)
    (target / spec.name / "config.pbtxt").write_text(configs.render(spec))
    (target / spec.name / "1" / "model.py").write_text(MINIMAL.read_text())


def write_minimal(target: Path, pipeline_config: Path) -> None:
    """The anchor as ``pipeline_minimal`` beside a repository's ``pipeline``, with that
    ``pipeline``'s config (its stage models and batching) under its own name."""
    (target / "pipeline_minimal" / "1").mkdir(parents=True)
    (target / "pipeline_minimal" / "config.pbtxt").write_text(
        pipeline_config.read_text().replace('name: "pipeline"', 'name: "pipeline_minimal"', 1))
    (target / "pipeline_minimal" / "1" / "model.py").write_text(MINIMAL.read_text())


def side_by_side(server, models: dict[str, str], rounds: int, levels=(16, 64),
                 seconds: float = 8.0, quick: bool = False) -> dict[str, dict[str, list[float]]]:
    """The figures the anchor targets are about, for each of ``models`` (key -> model), in
    ``rounds`` interleaved rounds (the order reversed every other round: this host's speed moves
    by tens of percent within minutes): p50 at concurrency 1 (µs, perf_analyzer), and at each of
    ``levels`` the throughput (req/s) and, at the first, the model's stubs' CPU per request (ms).
    Returns key -> figure -> one value per round. ``quick``: smoke settings (no claims)."""
    from bench import perf, profile

    out = {key: {"p50_c1_us": [], **{f"rps_c{c}": [] for c in levels}, "stub_cpu_ms": []}
           for key in models}
    for model in models.values():  # unmeasured: first runs (ONNX Runtime arenas, threads)
        profile.drive(server, model, levels[-1], 1.0 if quick else 5.0, **QUICK_DRIVE)
    for index in range(rounds):
        order = list(models.items()) if index % 2 == 0 else list(models.items())[::-1]
        for key, model in order:
            p50 = perf.p50_at_1(server, model, quick)
            if p50 is not None:
                out[key]["p50_c1_us"].append(p50)
            for level in levels:
                load = profile.drive(server, model, level, seconds, **QUICK_DRIVE if quick
                                     else {"warmup": 3.0})
                out[key][f"rps_c{level}"].append(load.requests / load.seconds)
                if level == levels[0]:
                    out[key]["stub_cpu_ms"].append(
                        load.cpu_ms_per_request().get(f"{model} stubs", 0.0))
    return out


def paired(figures: dict, key: str, base: str, figure: str, difference: bool = False
           ) -> list[float]:
    """Round by round, ``key``'s figure over (or minus) ``base``'s."""
    return [a - b if difference else a / b
            for a, b in zip(figures[key][figure], figures[base][figure]) if b]


def add_rounds(result, figures: dict) -> None:
    """One CSV row per anchor figure and round (``figures``: key -> figure -> per-round values)
    in ``result``, and the rounds themselves in its JSON data."""
    for key, values in figures.items():
        for figure, per_round in values.items():
            for index, value in enumerate(per_round):
                result.rows.append({"experiment": result.name, "variant": f"anchor: {key}",
                                    "scenario": "targets", "figure": figure,
                                    "round": index + 1, "value": round(value, 3)})
    result.data["anchor_rounds"] = figures


def summary(values: list[float], digits: int = 2) -> str:
    """``median (min–max)`` of ``values``."""
    if not values:
        return "not measured"
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–"
            f"{max(values):.{digits}f})")
