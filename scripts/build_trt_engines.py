#!/usr/bin/env python3
"""Build the TensorRT engines of a ``gpu-trt`` profile repository, on the GPU that will run them.

Engines are specific to the GPU model, the TensorRT version and the build settings, so they are
built where they run (at container start, ``scripts/container-serve.sh``) and cached: an engine
is rebuilt only when its key changes (ONNX file, TensorRT version, GPU name, precision, shapes).

    python3 scripts/build_trt_engines.py --repository /var/cache/bls/repository-gpu-trt
    python3 scripts/build_trt_engines.py --repository REPO --dry-run   # no GPU, no TensorRT needed

For every ``<model>_trt`` directory (``platform: "tensorrt_plan"``) it reads that config — the
optimisation profile's min/opt/max shapes come from its ``max_batch_size``, dims and preferred
batch sizes, the same spec the ONNX export and every config come from
(``modelgen.profiles.optimisation_shapes``) — checks that the ONNX file of ``<model>`` has exactly
the config's inputs, builds the engine with the TensorRT Python API (FP16 where the GPU has fast
FP16) and links it as ``<model>_trt/1/model.plan``. ``--dry-run`` does all of that except
importing TensorRT and building; it prints the plan.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bls_models import spec as S  # noqa: E402 - after sys.path: run as a script
from modelgen import configs, profiles  # noqa: E402 - after sys.path: run as a script


def plan(repository: Path) -> list[dict]:
    """One entry per engine to build, from the repository's ``*_trt`` configs."""
    entries = []
    for config_path in sorted(repository.glob("*_trt/config.pbtxt")):
        config = configs.parse_pbtxt(config_path.read_text())
        if config.platform != "tensorrt_plan":
            continue
        source = config.name.removesuffix("_trt")
        spec = S.model(source)
        shapes = profiles.optimisation_shapes(spec)
        declared = {t.name: tuple(t.dims) for t in config.input}
        if declared != {t.name: t.dims for t in spec.inputs}:
            raise SystemExit(f"{config_path}: inputs {declared} differ from {source}'s spec")
        if config.max_batch_size != spec.max_batch_size:
            raise SystemExit(f"{config_path}: max_batch_size {config.max_batch_size} differs from "
                             f"{source}'s spec ({spec.max_batch_size})")
        entries.append({"model": config.name, "onnx": str(repository / source / "1" / "model.onnx"),
                        "engine": str(repository / config.name / "1" / "model.plan"),
                        "shapes": {name: [list(s) for s in triple] for name, triple in shapes.items()},
                        "outputs": [t.name for t in config.output]})
    return entries


def check_onnx(entry: dict) -> None:
    """The ONNX file's inputs must be the config's, with a dynamic batch axis."""
    import onnx

    graph = onnx.load(entry["onnx"], load_external_data=False).graph
    initialisers = {i.name for i in graph.initializer}
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
              for i in graph.input if i.name not in initialisers}
    for name, (minimum, _, _) in entry["shapes"].items():
        dims = inputs.get(name)
        if dims is None:
            raise SystemExit(f"{entry['onnx']}: no input '{name}' (has {sorted(inputs)})")
        if [d for d in dims[1:]] != minimum[1:] or isinstance(dims[0], int) and dims[0] > 0:
            raise SystemExit(f"{entry['onnx']}: input '{name}' is {dims}, the config needs "
                             f"[batch, {minimum[1:]}] with a dynamic batch axis")
    outputs = {o.name for o in graph.output}
    missing = set(entry["outputs"]) - outputs
    if missing:
        raise SystemExit(f"{entry['onnx']}: no output(s) {sorted(missing)}")


def cache_key(entry: dict, trt_version: str, gpu: str, fp16: bool) -> str:
    digest = hashlib.sha256(Path(entry["onnx"]).read_bytes()).hexdigest()
    blob = json.dumps([digest, trt_version, gpu, fp16, entry["shapes"]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def gpu_name() -> str:
    """The first GPU's name (nvidia-smi is injected by the NVIDIA container toolkit)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.strip() or "unknown-gpu"
    except (OSError, subprocess.SubprocessError):
        return "unknown-gpu"


def build(entry: dict, cache: Path, workspace: int, log) -> Path:
    try:
        import tensorrt as trt
    except ImportError:  # the bare bindings wheel (tensorrt-cu12-bindings) over the image's libs
        import tensorrt_bindings as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    fp16 = bool(builder.platform_has_fast_fp16)
    gpu = gpu_name()
    key = cache_key(entry, trt.__version__, gpu, fp16)
    cached = cache / f"{entry['model']}-{key}.plan"
    if cached.exists():
        log(f"{entry['model']}: cached engine {cached.name} ({gpu}, TensorRT {trt.__version__})")
        return cached
    log(f"{entry['model']}: building on {gpu}, TensorRT {trt.__version__}, "
        f"{'FP16' if fp16 else 'FP32'} (minutes) ...")
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(entry["onnx"]):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SystemExit(f"{entry['onnx']}: TensorRT could not parse it: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name_, (minimum, opt, maximum) in entry["shapes"].items():
        profile.set_shape(name_, minimum, opt, maximum)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise SystemExit(f"{entry['model']}: the engine build failed (see TensorRT's log above)")
    publish(cached, bytes(engine))
    return cached


def publish(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through a temporary file of its own beside it, then rename it
    over ``target`` (atomic within a file system). A crash mid-write never leaves a truncated
    engine, and containers that share the cache and build the same engine at once never write
    the same file: each renames its own complete copy, the last one wins, and both are the same
    engine (the name is its key)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide it from another user's container
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True,
                        help="a repository rendered with `python -m modelgen.profiles --profile gpu-trt`")
    parser.add_argument("--cache", type=Path,
                        default=Path(os.environ.get("BLS_CACHE", profiles.DEFAULT_CACHE)) / "engines")
    parser.add_argument("--workspace-bytes", type=int, default=profiles.TRT_WORKSPACE_BYTES)
    parser.add_argument("--dry-run", action="store_true",
                        help="check configs and ONNX files and print the plan; no TensorRT, no GPU")
    args = parser.parse_args(argv)
    entries = plan(args.repository)
    if not entries:
        raise SystemExit(f"no *_trt models in {args.repository} (render the gpu-trt profile first)")
    for entry in entries:
        check_onnx(entry)
    if args.dry_run:
        for entry in entries:
            shapes = "; ".join(f"{name} min {'x'.join(map(str, lo))} opt {'x'.join(map(str, opt))} "
                               f"max {'x'.join(map(str, hi))}"
                               for name, (lo, opt, hi) in entry["shapes"].items())
            print(f"{entry['model']}: {entry['onnx']} -> {entry['engine']} ({shapes}); "
                  f"outputs {', '.join(entry['outputs'])}")
        print(f"dry run: {len(entries)} engine(s) planned, cached in {args.cache}; configs and "
              "ONNX files agree; nothing built")
        return 0
    for entry in entries:
        engine = build(entry, args.cache, args.workspace_bytes, lambda m: print(m, flush=True))
        target = Path(entry["engine"])
        target.unlink(missing_ok=True)
        target.symlink_to(engine)
        print(f"{entry['model']}: {target} -> {engine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
