"""Deployment profiles of the model repository: the committed one, and GPU variants of it.

The committed ``model_repository/`` is **portable**: no instance ``kind`` on the ONNX models
(KIND_AUTO: CPU here, one group per GPU in the container), the orchestrators on KIND_CPU. The
GPU profiles are rendered from the same specs into a directory of their own, at container start
(``scripts/container-serve.sh``) or by hand:

    python -m modelgen.profiles --profile gpu-trt --source model_repository --out /tmp/repo-gpu-trt
    python -m modelgen.profiles --profile gpu --source model_repository --out X --dry-run

Profiles:

* ``gpu`` — KIND_GPU instance groups with per-GPU counts (``GPU_INSTANCES``); ONNX models on
  ONNX Runtime's CUDA execution provider; ``pipeline`` with ``gpu_tensors: "on"`` (PIXELS stays
  on the GPU between preprocess and the two CNNs).
* ``gpu-ort-trt`` — ``gpu`` plus ONNX Runtime's TensorRT execution accelerator on every ONNX
  model: FP16, an explicit optimisation profile per input (batch 1 to ``max_batch_size``, from
  the spec), so each engine is built when the model loads, not on the first requests; engines
  cached under ``<cache>/ort-trt/<model>``, which rendering creates.
* ``gpu-trt`` — ``gpu`` plus native TensorRT models (``<model>_trt``, ``platform:
  "tensorrt_plan"``) for the CNN stages, whose engines ``scripts/build_trt_engines.py`` builds
  from the ONNX files on the target GPU; ``pipeline`` calls them through its stage parameters
  (``classifier_model: "classifier_trt"``) — no code change.

Every config is parsed into Triton's ``ModelConfig`` protobuf as it is rendered; each
orchestrator's stages are checked against the rendered repository exactly as the orchestrator
checks them at load time (``bls_models.repository``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
from pathlib import Path

from google.protobuf import text_format

from bls_models import spec as S
from bls_models.spec import registered
from modelgen import configs

PROFILES = ("gpu", "gpu-ort-trt", "gpu-trt")
DEFAULT_CACHE = "/var/cache/bls"
# Instances per GPU. The CNNs get 2 so one instance's batch is formed while the other's runs;
# the taggers return 28.7 MB per sequence and gain nothing from a second copy of their weights;
# digits_small is tiny (its batches cost less than a sub-request); digits_large is a CNN like the
# classifier.
GPU_INSTANCES = {"preprocess": 1, "classifier": 2, "embedder": 2, "tagger": 1, "tagger_tags": 1,
                 "postprocess": 1, "digits_small": 1, "digits_large": 2}
# Stages served by native TensorRT engines in `gpu-trt`: FP32 in, FP32 out, the heavy networks.
# (The tagger's INT64 token input and preprocess's UINT8 image stay on ONNX Runtime.)
TRT_MODELS = ("classifier", "embedder")
TRT_WORKSPACE_BYTES = 2 * 2**30
_DTYPE_BYTES = {"TYPE_UINT8": 1, "TYPE_FP32": 4, "TYPE_INT64": 8}
# ONNX Runtime's CPU threads on GPU instances, decided apart from the CPU profile's
# (spec.ORT_CPU_PARAMETERS). With the CUDA or TensorRT provider the kernels run on the GPU; a
# session's CPU threads only run the few CPU-placed nodes and launch work, and several sessions
# share the host's cores (6 instances per GPU here, up to 8 GPUs per host). Two intra-op threads
# leave room for CPU-placed nodes without a per-session pool of every core. Not yet measured on
# a GPU: `make bench-ort_options` on the GPU host is where to revisit it.
GPU_ORT_PARAMETERS = {"intra_op_thread_count": "2", "inter_op_thread_count": "1"}


def cuda_pool_need() -> dict[str, int]:
    """Bytes of Triton's CUDA memory pool one GPU uses at once in the GPU profiles, by what
    holds them (docs/production.md, "The CUDA memory pool"). Rows in flight per model and GPU:
    ``instances x max_batch_size x 2``, one batch running per instance and the next one forming.

    * ``bls_inputs``: every sub-request that sends a pass-through tensor still on the GPU gets
      its own device copy, allocated from the pool by the python backend (python_be.cc r24.10);
      for PIXELS, each of its consumers' rows in flight.
    * ``bls_outputs``: the pass-through outputs themselves (the producer's response, allocated
      from the pool), alive until the request's last consumer answers: the rows in flight of
      the busiest consumer.
    * ``batch_buffers``: the onnxruntime backend gathers a batch's inputs into one contiguous GPU
      buffer from the pool (backend_input_collector.cc r24.10): the rows every GPU instance of
      every ONNX model runs or forms at once."""
    def rows(model: S.ModelSpec) -> int:
        return GPU_INSTANCES[model.name] * model.max_batch_size * 2

    def row_bytes(tensor: S.TensorSpec) -> int:
        return _DTYPE_BYTES[tensor.dtype] * math.prod(tensor.dims)

    inputs = outputs = 0
    for definition in S.PIPELINE_DEFS:
        for names in definition.pass_through.values():
            for name in names:
                consumers = [s.contracts[0] for s in definition.stages
                             if any(t.name == name for t in s.contracts[0].inputs)]
                tensor = next(t for c in consumers for t in c.inputs if t.name == name)
                inputs += sum(rows(c) for c in consumers) * row_bytes(tensor)
                outputs += max(rows(c) for c in consumers) * row_bytes(tensor)
    batches = sum(GPU_INSTANCES[m.name] * m.max_batch_size * sum(row_bytes(t) for t in m.inputs)
                  for m in S.ONNX_MODELS)
    return {"bls_inputs": inputs, "bls_outputs": outputs, "batch_buffers": batches}


def cuda_pool_bytes() -> int:
    """The pool per GPU: ``cuda_pool_need`` with half again for the pool's fragmentation, rounded
    up to a power of two (256 MiB, the largest pool Triton's own BLS tests run with)."""
    return 1 << math.ceil(math.log2(sum(cuda_pool_need().values()) * 1.5))


def trt_name(model: str) -> str:
    return f"{model}_trt"


def optimisation_shapes(model: S.ModelSpec) -> dict[str, tuple[tuple[int, ...], ...]]:
    """TensorRT optimisation profile per input: (min, opt, max) shapes with the batch axis, from
    the same spec as the config's ``max_batch_size`` and dims. ``opt`` is the largest preferred
    batch size (the dynamic batcher aims for it), or half the maximum."""
    preferred = model.batching.preferred_batch_sizes if model.batching else ()
    opt = max(preferred) if preferred else max(1, model.max_batch_size // 2)
    return {t.name: ((1, *t.dims), (opt, *t.dims), (model.max_batch_size, *t.dims))
            for t in model.inputs}


def trt_profile_shapes(model: S.ModelSpec) -> dict[str, str]:
    """ONNX Runtime's TensorRT provider options for an explicit optimisation profile, from
    ``optimisation_shapes``: ``trt_profile_{min,opt,max}_shapes``, each ``NAME:1x3x224x224`` with
    one entry per input, comma-separated (onnxruntime_backend r24.10 passes these keys to ONNX
    Runtime as given, src/onnxruntime.cc). With all three set for every dynamic input, ONNX
    Runtime builds the engine when the session is created, i.e. when the model loads, and never
    rebuilds it for a larger batch; without them it builds on the first request and again for
    every batch larger than any seen."""
    shapes = optimisation_shapes(model)
    return {f"trt_profile_{which}_shapes": ",".join(
                f"{name}:{'x'.join(map(str, triple[index]))}" for name, triple in shapes.items())
            for index, which in enumerate(("min", "opt", "max"))}


def ort_trt_cache(cache: str, model: str) -> str:
    """Where ONNX Runtime's TensorRT provider keeps ``model``'s engines."""
    return f"{cache}/ort-trt/{model}"


def warmup_samples(model: S.ModelSpec) -> list[dict]:
    """``model_warmup`` of a GPU model: one sample of zeros per batch size, 1 to
    ``max_batch_size``, run by each instance before the server reports ready. The onnxruntime
    backend runs ONNX Runtime's CUDA provider with ``cudnn_conv_algo_search`` EXHAUSTIVE unless
    told otherwise (src/onnxruntime.cc r24.10): the first batch of every new size benchmarks
    every convolution's algorithms, a stall of up to seconds on a request already in flight. A
    TensorRT engine needs no such search; warming it runs its first executions. (Triton sends a
    sample of ``batch_size`` N as N one-row requests, which the backend runs as one batch.)"""
    return [{"name": f"batch_{n}", "batch_size": n,
             "inputs": {t.name: {"data_type": t.dtype, "dims": list(t.dims), "zero_data": True}
                        for t in model.inputs}}
            for n in range(1, model.max_batch_size + 1)]


def _gpu_group(model: S.ModelSpec) -> list[dict]:
    return [{"count": GPU_INSTANCES.get(model.name.removesuffix("_trt"), model.instance_count),
             "kind": "KIND_GPU"}]


def profile_config(model: S.ModelSpec, profile: str, cache: str = DEFAULT_CACHE) -> dict:
    """The config dict of ``model`` in ``profile``."""
    config = configs.config_dict(model)
    if model.backend in ("onnxruntime", "") and model.platform != "ensemble":
        config["instance_group"] = _gpu_group(model)
    if model.backend == "onnxruntime":
        config["parameters"].update({k: {"string_value": v} for k, v in GPU_ORT_PARAMETERS.items()})
    if model.backend == "onnxruntime" or model.platform == "tensorrt_plan":
        config["model_warmup"] = warmup_samples(model)
    if profile == "gpu-ort-trt" and model.backend == "onnxruntime":
        config["optimization"] = {"execution_accelerators": {"gpu_execution_accelerator": [{
            "name": "tensorrt",
            "parameters": {"precision_mode": "FP16",
                           "max_workspace_size_bytes": str(TRT_WORKSPACE_BYTES),
                           "trt_engine_cache_enable": "1",
                           "trt_engine_cache_path": ort_trt_cache(cache, model.name),
                           **trt_profile_shapes(model)}}]}}
    if model.orchestrates and registered(model.orchestrates).pass_through:
        # Pass-through outputs (PIXELS) stay on the GPU between stages (DLPack).
        config["parameters"]["gpu_tensors"] = {"string_value": "on"}
    if profile == "gpu-trt" and model.name == S.PIPELINE.name:
        config["parameters"].update({f"{stage}_model": {"string_value": trt_name(stage)}
                                     for stage in TRT_MODELS})
    return config


def trt_spec(model: S.ModelSpec) -> S.ModelSpec:
    """The native TensorRT variant of an ONNX model: same tensors, batching and limits."""
    return dataclasses.replace(model, name=trt_name(model.name), backend="",
                               platform="tensorrt_plan",
                               description=f"TensorRT engine built from {model.name}'s ONNX file")


def profile_models(profile: str) -> list[S.ModelSpec]:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile '{profile}'; choose from {', '.join(PROFILES)}")
    models = list(S.ALL_MODELS)
    if profile == "gpu-trt":
        models += [trt_spec(S.model(name)) for name in TRT_MODELS]
    return models


def render(profile: str, cache: str = DEFAULT_CACHE) -> dict[str, str]:
    """Model name -> config.pbtxt text (each parsed through Triton's protobuf on the way)."""
    rendered = {}
    for model in profile_models(profile):
        proto = configs.to_proto(profile_config(model, profile, cache))
        text = (f"# Profile '{profile}', generated from bls_models/spec.py by "
                "`python -m modelgen.profiles`; do not edit.\n" + text_format.MessageToString(proto))
        configs.parse_pbtxt(text)  # what Triton's loader will do
        rendered[model.name] = text
    return rendered


def cache_directories(profile: str, cache: str = DEFAULT_CACHE) -> list[Path]:
    """The directories the served configs of ``profile`` write to, which must exist before the
    models load: ONNX Runtime's TensorRT provider creates only the last level of its
    ``trt_engine_cache_path`` and throws when that fails, and the instances of a model load in
    parallel, racing to create it."""
    if profile != "gpu-ort-trt":
        return []
    return [Path(ort_trt_cache(cache, m.name)) for m in profile_models(profile)
            if m.backend == "onnxruntime"]


def write(profile: str, source: Path, out: Path, cache: str = DEFAULT_CACHE) -> list[str]:
    """Render ``profile`` into ``out`` (replaced) and create its cache directories. Version
    directories link to ``source``'s files (ONNX models, model.py); a ``*_trt`` model gets an
    empty version directory for its engine. Returns the problems found by the orchestrators' own
    load-time stage check (none expected)."""
    for directory in cache_directories(profile, cache):
        directory.mkdir(parents=True, exist_ok=True)  # several containers may share the cache
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, text in render(profile, cache).items():
        (out / name / "1").mkdir(parents=True)
        (out / name / "config.pbtxt").write_text(text)
        version = source / name / "1"
        if version.is_dir():
            for item in version.iterdir():
                if item.name != ".gitkeep":
                    os.symlink(item.resolve(), out / name / "1" / item.name)
    return stage_problems(out)


def stage_problems(repository: Path) -> list[str]:
    """Each orchestrator's stages against ``repository``, as the orchestrator checks them."""
    from bls_models import repository as repo_check

    problems = []
    for model in S.BLS_MODELS:
        config = configs.parse_pbtxt((repository / model.name / "config.pbtxt").read_text())
        definition = registered(model.orchestrates)
        stages = definition.parse({k: v.string_value for k, v in config.parameters.items()}).stages
        problems += [f"{model.name}: {p}" for p in repo_check.stage_problems(
            [repository], stages, definition.contracts)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modelgen.profiles",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, required=True)
    parser.add_argument("--source", type=Path, default=Path("model_repository"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", default=os.environ.get("BLS_CACHE", DEFAULT_CACHE),
                        help="where engines are cached (default $BLS_CACHE or /var/cache/bls)")
    parser.add_argument("--dry-run", action="store_true",
                        help="render and check every config, print the plan, write nothing")
    args = parser.parse_args(argv)
    rendered = render(args.profile, args.cache)
    if args.dry_run:
        for model in profile_models(args.profile):
            config = configs.parse_pbtxt(rendered[model.name])
            kinds = configs.model_config_pb2.ModelInstanceGroup.Kind
            groups = ", ".join(f"{g.count} x {kinds.Name(g.kind)}"
                               for g in config.instance_group) or "-"
            kind = config.platform or config.backend
            print(f"{model.name:<20} {kind:<14} instances: {groups}")
        print(f"profile '{args.profile}': {len(rendered)} configs parse; nothing written (dry run)")
        return 0
    problems = write(args.profile, args.source, args.out, args.cache)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    print(f"profile '{args.profile}' written to {args.out} ({len(rendered)} models)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
