"""What the runtime is measured against, and the benchmark-only ways of orchestrating `pipeline`.

* ``pipeline_minimal`` (``bench/models/minimal.py``): the plainest per-batch BLS, the anchor of
  the overhead and orchestration experiments;
* ``design_naive_<n>`` (``bench/models/naive.py``): Triton's BLS example pattern, an ``async def
  execute`` awaiting ``async_exec`` per request;
* ``pipeline_sequential``: the runtime with a run function that awaits the classifier, then the
  embedder (the fan-out experiment's baseline).

None of these is part of the production repository; ``write`` renders one into a benchmark or
test repository with ``pipeline``'s contract and batching.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from bls_models import spec as S
from bls_models.pipelines import softmax_top_k
from modelgen import configs

MODELS = Path(__file__).resolve().parent / "models"
# ``profile.drive``'s warm-up and tail on smoke settings: seconds of waiting, no claims.
QUICK_DRIVE = {"warmup": 0.5, "tail": 1.0}
MINIMAL = MODELS / "minimal.py"
NAIVE = MODELS / "naive.py"


async def sequential_image_pipeline(inputs, call, setup):
    """``pipeline``'s run function with its branches one after the other."""
    pixels = (await call("preprocess", {S.IMAGE.name: inputs[S.IMAGE.name]},
                         [S.PIXELS.name]))[S.PIXELS.name]
    logits = (await call("classifier", {S.PIXELS.name: pixels},
                         [S.CLASS_LOGITS.name]))[S.CLASS_LOGITS.name]
    embedding = (await call("embedder", {S.PIXELS.name: pixels},
                            [S.EMBEDDING.name]))[S.EMBEDDING.name]
    ids, probs = softmax_top_k(logits)
    return {S.CLASS_IDS.name: ids, S.CLASS_PROBS.name: probs, S.EMBEDDING.name: embedding}


SEQUENTIAL = dataclasses.replace(S.PIPELINE_DEF, name="pipeline_sequential",
                                 run="bench.anchors:sequential_image_pipeline")
SEQUENTIAL_MODEL_PY = ('"""`pipeline` with its branches one after the other (bench only)."""\n\n'
                       "from bench.anchors import SEQUENTIAL\n"
                       "from bls_models.triton_runtime import python_model\n\n"
                       "TritonPythonModel = python_model(SEQUENTIAL)\n")


def like_pipeline(name: str, instances: int | None = None, **parameters: str) -> S.ModelSpec:
    """``pipeline``'s contract, batching and parameters under ``name``."""
    return dataclasses.replace(
        S.PIPELINE, name=name, instance_count=instances or S.PIPELINE.instance_count,
        parameters={**S.PIPELINE.parameters, **parameters})


def write(target: Path, spec: S.ModelSpec, source: Path | str | None = None) -> None:
    """``spec``'s config and model.py into ``target``: ``source`` (a file, or the text), or the
    runtime's generated model.py for the pipeline ``spec`` orchestrates."""
    (target / spec.name / "1").mkdir(parents=True)
    (target / spec.name / "config.pbtxt").write_text(configs.render(spec))
    if source is None:
        text = configs.model_py(spec.orchestrates)
    elif isinstance(source, Path):
        text = source.read_text()
    else:
        text = source
    (target / spec.name / "1" / "model.py").write_text(text)


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
