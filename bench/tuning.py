"""Configuration sweeps whose winners are committed in `bls_models/spec.py` (and checked there by
tests/tooling/test_tuned_values.py): instances, batching delay and preferred batch sizes per model
(`make bench-tuning`), and the ONNX Runtime options of Triton's onnxruntime backend
(`make bench-ort_options`). Every variant is served by a server of its own."""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import perf
from bench.common import Context, Result, best_point
from bench.perf import Point
from bls_models import spec as S
from modelgen import export, variants
from tritonlocal import TritonServer, on_free_ports

# A coordinate sweep, as Model Analyzer's "quick" search does: instance count first (the largest
# effect on a CPU), then the batching delay at the best count, then preferred batch sizes at the
# best delay; then the orchestrator's instance count over the tuned sub-models. Each stage keeps
# the previous winner, so 3 + 2 + 2 variants per model are measured instead of the 27 of the
# full grid. Every variant is measured at every level of TUNING_LEVELS.
TUNING_INSTANCES = (1, 2, 4)
TUNING_DELAYS_US = (100, 500, 2000)
TUNING_PREFERRED = ((), (4, 8), (8, 16))
TUNING_LEVELS = (2, 4, 8, 16)
ORCHESTRATOR_INSTANCES = (1, 2, 4)
ORCHESTRATOR_LEVELS = (4, 8, 16, 32)
# The latency budget is relative, because absolute latency differs up to 2x between hosts of
# the same kind (measured: the classifier at 3.5 and at 7 ms per image): p95 under load may be at
# most BUDGET_FACTOR times the model's unloaded p50 (committed config, concurrency 1), measured
# in the same run. On a GPU host, replace it with the service's own p95 objective.
BUDGET_FACTOR = 4.0


@dataclass
class Candidate:
    stage: str
    spec: S.ModelSpec
    point: Point


def _knobs(spec: S.ModelSpec) -> dict:
    return {"instance_count": spec.instance_count,
            "max_queue_delay_us": spec.batching.max_queue_delay_us,
            "preferred_batch_sizes": list(spec.batching.preferred_batch_sizes)}


def _describe(spec: S.ModelSpec) -> str:
    k = _knobs(spec)
    preferred = ",".join(map(str, k["preferred_batch_sizes"])) or "none"
    if spec.backend == "python":
        return f"{k['instance_count']} instances"
    return f"{k['instance_count']} inst, delay {k['max_queue_delay_us']} µs, preferred {preferred}"


def _tuned(model: S.ModelSpec, instances: int | None = None, delay: int | None = None,
           preferred: tuple[int, ...] | None = None) -> S.ModelSpec:
    instances = model.instance_count if instances is None else instances
    batching = model.batching
    if delay is not None:
        batching = dataclasses.replace(batching, max_queue_delay_us=delay)
    if preferred is not None:
        batching = dataclasses.replace(batching, preferred_batch_sizes=preferred)
    return dataclasses.replace(model, instance_count=instances, batching=batching)


def _measure_stage(ctx: Context, result: Result, stage: str, base: S.ModelSpec,
                   specs: list[S.ModelSpec], levels: list[int], write, baseline: bool = False
                   ) -> tuple[list[Candidate], float | None]:
    """Serve ``specs`` (renamed ``base__<n>``) on a server of their own and measure each at
    ``levels``; with ``baseline``, also the committed ``base`` at concurrency 1 (the unloaded
    p50 the budget is relative to)."""
    named = [dataclasses.replace(spec, name=f"{base.name}__{stage}{n}") for n, spec in enumerate(specs)]
    candidates, unloaded = [], None
    with tempfile.TemporaryDirectory(prefix="tuning-") as tmp:
        repo = Path(tmp) / "repo"
        write(repo, named + ([dataclasses.replace(base, name=f"{base.name}__committed")]
                             if baseline else []))
        with TritonServer(on_free_ports(repo, Path(tmp) / "tritonserver.log")) as server:
            if baseline:
                run = perf.run(f"{base.name}__committed", server.grpc_url, [1], ctx.settings)
                result.add_run(f"{base.name} committed (unloaded)", run, model=base.name,
                               stage="unloaded", **_knobs(base))
                unloaded = run.points[0].p50_ms if run.points else None
            for spec, original in zip(named, specs):
                run = perf.run(spec.name, server.grpc_url, levels, ctx.settings)
                points = result.add_run(f"{base.name}: {_describe(spec)}", run, model=base.name,
                                        stage=stage, **_knobs(spec))
                candidates += [Candidate(stage, original, p) for p in points]
    return candidates, unloaded


def _pick(candidates: list[Candidate], budget: float | None) -> Candidate | None:
    within = [c for c in candidates if budget is not None and c.point.p95_ms <= budget]
    return max(within, key=lambda c: c.point.throughput) if within else None


def _onnx_writer(ctx: Context, model: S.ModelSpec):
    def write(repo: Path, specs: list[S.ModelSpec]) -> None:
        for spec in specs:
            variants.write_onnx(repo, spec, export.onnx_path(ctx.repository, model))
    return write


def tune_sub_model(ctx: Context, result: Result, model: S.ModelSpec, levels: list[int]
                   ) -> tuple[S.ModelSpec, Candidate | None, float | None, list[Candidate]]:
    """Instances, then delay, then preferred sizes: (winner spec, its point, budget, all points)."""
    write = _onnx_writer(ctx, model)
    cands, budget, best = _instances_stage(ctx, result, "i", model, TUNING_INSTANCES, levels,
                                           write)
    seen = list(cands)
    if ctx.quick:
        return (best.spec if best else model), best, budget, seen
    current = best.spec if best else model
    for stage, options, knob in (("d", TUNING_DELAYS_US, "delay"),
                                 ("p", TUNING_PREFERRED, "preferred")):
        fresh = [spec for spec in (_tuned(current, **{knob: v}) for v in options)
                 if spec != current]
        more, _ = _measure_stage(ctx, result, stage, model, fresh, levels, write)
        seen += more
        kept = [c for c in cands if c.spec == current]
        cands = kept + more
        best = _pick(cands, budget) or best
        current = best.spec if best else current
    return current, best, budget, seen


def tune_orchestrator(ctx: Context, result: Result, tuned: dict[str, S.ModelSpec],
                      levels: list[int]
                      ) -> tuple[S.ModelSpec, Candidate | None, float | None, list[Candidate]]:
    """The pipeline's instance count, over the tuned sub-models (served under their own names)."""
    base = S.PIPELINE

    def write(repo: Path, specs: list[S.ModelSpec]) -> None:
        for name, spec in tuned.items():
            variants.write_onnx(repo, spec, export.onnx_path(ctx.repository, S.model(name)))
        for spec in specs:
            spec = dataclasses.replace(spec, parameters={**spec.parameters,
                                                         "stage_model_repositories": str(repo)})
            variants.write(repo, spec)

    cands, budget, best = _instances_stage(ctx, result, "o", base, ORCHESTRATOR_INSTANCES,
                                           levels, write)
    return (best.spec if best else base), best, budget, cands


def _instances_stage(ctx: Context, result: Result, stage: str, model: S.ModelSpec, counts,
                     levels: list[int], write) -> tuple[list[Candidate], float | None,
                                                        Candidate | None]:
    """The first tuning stage (instance counts, with the unloaded baseline that sets the latency
    budget): (candidates, budget, best within it)."""
    counts = [1, 2] if ctx.quick else list(counts)
    cands, unloaded = _measure_stage(ctx, result, stage, model,
                                     [_tuned(model, instances=n) for n in counts],
                                     levels, write, baseline=True)
    budget = unloaded * BUDGET_FACTOR if unloaded else None
    return cands, budget, _pick(cands, budget)


def tuning(ctx: Context) -> Result:
    """Per sub-model of ``pipeline``: the highest throughput whose p95 is within the budget,
    over instance count, batching delay and preferred batch sizes; then the orchestrator."""
    result = Result("tuning", "Tuning: instances, batching delay and preferred batch sizes")
    models = [S.CLASSIFIER] if ctx.quick else [S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER]
    levels = [2] if ctx.quick else list(TUNING_LEVELS)
    result.summary += [
        f"Coordinate sweep per model: instances {list(TUNING_INSTANCES)}, then "
        f"max_queue_delay_microseconds {list(TUNING_DELAYS_US)} at the best count, then "
        f"preferred_batch_size {[list(p) for p in TUNING_PREFERRED]} at the best delay; each "
        f"variant at concurrency {levels}. Then `pipeline`'s instance count "
        f"{list(ORCHESTRATOR_INSTANCES)} over the tuned sub-models, at concurrency "
        f"{list(ORCHESTRATOR_LEVELS)}. Winner: the highest throughput whose p95 is within the "
        f"budget, {BUDGET_FACTOR:g}× the model's unloaded p50 (committed config, concurrency 1, "
        "same run).", ""]
    table = ["| model | committed | winner | throughput (req/s) | p95 (ms) | budget (ms) |"
             " committed's best within budget (req/s) |", "|---|---|---|---|---|---|---|"]
    winners: dict[str, dict] = {}
    tuned: dict[str, S.ModelSpec] = {}

    def row(model: S.ModelSpec, spec: S.ModelSpec, best: Candidate | None, budget, cands):
        committed_best = _pick([c for c in cands if c.spec == _tuned(model)], budget)
        mine = f"{committed_best.point.throughput:.0f}" if committed_best else "none"
        if best is None:
            table.append(f"| {model.name} | {_describe(model)} | none within budget "
                                  f"(kept committed) | | | {budget or 0:.1f} | {mine} |")
            return
        winners[model.name] = _knobs(spec) | {"throughput": round(best.point.throughput, 1),
                                              "p95_ms": best.point.p95_ms,
                                              "concurrency": best.point.concurrency,
                                              "budget_ms": round(budget, 2)}
        table.append(
            f"| {model.name} | {_describe(model)} | **{_describe(spec)}** (at concurrency "
            f"{best.point.concurrency}) | {best.point.throughput:.0f} | {best.point.p95_ms:.1f} "
            f"| {budget:.1f} | {mine} |")

    for model in models:
        spec, best, budget, seen = tune_sub_model(ctx, result, model, levels)
        tuned[model.name] = spec
        row(model, spec, best, budget, seen)
    if not ctx.quick:
        row(S.PIPELINE, *tune_orchestrator(ctx, result, tuned, list(ORCHESTRATOR_LEVELS)))
    result.data = {"winners": winners, "budget_factor": BUDGET_FACTOR}
    result.summary += [
        "", *table, "", "The committed values in `bls_models/spec.py` are these winners (a unit "
        "test, `tests/tooling/test_tuned_values.py`, fails when they drift apart). Differences of a few "
        "percent are within this machine's noise. On a GPU host: `make bench-tuning` runs the "
        "same sweep (instances become per-GPU counts under KIND_AUTO); set the budget to the "
        "service's p95 objective, apply the winners in `bls_models/spec.py`, `make configs`."]
    result.plot = {"kind": "curve", "title": "Tuning: throughput vs p95 per variant",
                   "facet": "model"}
    return result


# Each candidate is applied to every ONNX model that `pipeline` and `pipeline_ensemble` use,
# served under the committed names on a server of its own (so each run has the same processes),
# and both pipelines are measured at every level. The committed choice is
# spec.ORT_CPU_PARAMETERS; tests/tooling/test_tuned_values.py keeps it equal to this run's winner.
ORT_CANDIDATES: dict[str, dict] = {
    # Triton's default: no parameters, so ONNX Runtime sizes each session's pools to the cores.
    "ORT defaults": {},
    "threads 1/1": {"parameters": dict(S.ORT_CPU_PARAMETERS)},
    "threads 2/1": {"parameters": {"intra_op_thread_count": "2", "inter_op_thread_count": "1"}},
    "threads 1/1, memory arena off": {"parameters": {**S.ORT_CPU_PARAMETERS,
                                                     "enable_mem_arena": "0"}},
    "threads 1/1, memory pattern off": {"parameters": {**S.ORT_CPU_PARAMETERS,
                                                       "enable_mem_pattern": "0"}},
    # ORT_ENABLE_BASIC (level -1) instead of the backend's default ORT_ENABLE_ALL.
    "threads 1/1, basic graph optimisation": {"parameters": dict(S.ORT_CPU_PARAMETERS),
                                              "optimization": {"graph": {"level": -1}}},
}
ORT_MODELS = (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER, S.POSTPROCESS)


def ort_candidate_config(model: S.ModelSpec, candidate: dict) -> str:
    """``model``'s config.pbtxt with the candidate's ONNX Runtime options in place of the
    committed ones (parsed through Triton's protobuf)."""
    from google.protobuf import text_format

    from modelgen import configs

    config = configs.config_dict(dataclasses.replace(model, parameters={}))
    if candidate.get("parameters"):
        config["parameters"] = {k: {"string_value": v} for k, v in candidate["parameters"].items()}
    if "optimization" in candidate:
        config["optimization"] = candidate["optimization"]
    return text_format.MessageToString(configs.to_proto(config))


def ort_options(ctx: Context) -> Result:
    from modelgen import configs

    result = Result("ort_options", "ONNX Runtime options of Triton's onnxruntime backend (CPU)")
    names = (["ORT defaults", "threads 1/1"] if ctx.quick else list(ORT_CANDIDATES))
    levels = [2] if ctx.quick else [1, 4, 16]
    best: dict[str, dict[str, Point]] = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="ort-options-") as tmp:
            repo = Path(tmp) / "repo"
            for model in ORT_MODELS:
                (repo / model.name / "1").mkdir(parents=True)
                (repo / model.name / "config.pbtxt").write_text(
                    ort_candidate_config(model, ORT_CANDIDATES[name]))
                (repo / model.name / "1" / "model.onnx").symlink_to(
                    export.onnx_path(ctx.repository, model).resolve())
            variants.write(repo, S.PIPELINE)
            (repo / S.PIPELINE_ENSEMBLE.name / "1").mkdir(parents=True)
            (repo / S.PIPELINE_ENSEMBLE.name / "config.pbtxt").write_text(
                configs.render(S.PIPELINE_ENSEMBLE))
            with TritonServer(on_free_ports(repo, Path(tmp) / "tritonserver.log")) as server:
                for model in ("pipeline", "pipeline_ensemble"):
                    run = perf.run(model, server.grpc_url, levels, ctx.settings)
                    points = result.add_run(f"{model}: {name}", run, model=model, candidate=name)
                    if points:
                        best.setdefault(name, {})[model] = best_point(points)
    result.summary += [
        f"Each candidate applied to {', '.join(m.name for m in ORT_MODELS)} (committed instance "
        f"counts and batching), on a server of its own; perf_analyzer over gRPC at concurrency "
        f"{levels}. Best throughput of each (req/s):", "",
        "| candidate | `pipeline` | `pipeline_ensemble` |", "|---|---|---|"]
    for name in names:
        cells = [best.get(name, {}).get(m) for m in ("pipeline", "pipeline_ensemble")]
        result.summary.append(f"| {name} | " + " | ".join(
            f"{p.throughput:.0f} (c={p.concurrency}, p95 {p.p95_ms:.0f} ms)" if p else "–"
            for p in cells) + " |")
    # The winner: the highest sum of both pipelines' best throughput.
    scored = {n: sum(p.throughput for p in b.values()) for n, b in best.items() if len(b) == 2}
    winner = max(scored, key=scored.get) if scored else None
    if winner:
        result.data = {"winner": winner, "parameters": ORT_CANDIDATES[winner].get("parameters", {}),
                       "optimization": ORT_CANDIDATES[winner].get("optimization", {}),
                       "throughput": {n: {m: round(p.throughput, 1) for m, p in b.items()}
                                      for n, b in best.items()}}
        base = scored.get("ORT defaults")
        result.summary += ["", f"- Winner (highest sum of both): **{winner}**"
                           + (f", {scored[winner] / base:.2f}× the sum with ONNX Runtime's defaults."
                              if base else "."),
                           "- The committed `spec.ORT_CPU_PARAMETERS` must equal the winner "
                           "(`tests/tooling/test_tuned_values.py`); differences of a few percent are "
                           "within this machine's noise, so a candidate that adds a parameter "
                           "is kept only when it wins."]
    result.plot = {"kind": "curve", "title": "ONNX Runtime options: throughput vs p95",
                   "facet": "model"}
    return result
