"""`make bench-ort_options`: the ONNX Runtime options of Triton's onnxruntime backend, which Triton
Model Analyzer does not search (it sweeps instances, batch sizes and batching, not a backend's
own parameters; `make tune` does those). Each candidate is served by a server of its own; the
committed choice is ``spec.ORT_CPU_PARAMETERS``, kept equal to this run's winner by
tests/tooling/test_tuned_values.py."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from bench import perf
from bench.common import Context, Result, best_point
from bench.perf import Point
from bls_models import spec as S
from modelgen import export, variants
from tritonlocal import TritonServer, on_free_ports

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
