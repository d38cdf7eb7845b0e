"""Export the repository's ONNX models: ``python -m modelgen.export``.

Writes ``<repository>/<model>/1/model.onnx`` for every ONNX model in ``bls_models.spec``, with
the tensor names of the spec and a dynamic batch axis. Exports are deterministic (fixed seeds,
legacy TorchScript exporter), so two runs produce identical files.

A stamp file records a fingerprint of everything an export depends on (this package's sources,
the spec, the model size, the torch version); when it matches and every file exists the export
is skipped, so ``make serve`` and ``make test`` can call this unconditionally.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

from bls_models import spec as S

OPSET = 17
STAMP = ".export-stamp.json"
_SOURCES = [Path(__file__).with_name("nets.py"), Path(__file__), Path(S.__file__)]


def fingerprint(size: str) -> str:
    import torch

    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    digest.update(f"{size}|{torch.__version__}|{OPSET}".encode())
    return digest.hexdigest()


def onnx_path(repository: Path, model: S.ModelSpec, version: int = 1) -> Path:
    return repository / model.name / str(version) / "model.onnx"


def export_model(model: S.ModelSpec, path: Path, size: str) -> None:
    import torch

    from modelgen import nets

    net = nets.build(model.name, size)
    names_in = [t.name for t in model.inputs]
    names_out = [t.name for t in model.outputs]
    dynamic = {name: {0: "batch"} for name in names_in + names_out}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.tmp")
    with torch.no_grad(), warnings.catch_warnings():
        # The legacy exporter is chosen on purpose (deterministic, no onnxscript); skip its notice.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net, (nets.example_input(model),), str(tmp),
            input_names=names_in, output_names=names_out, dynamic_axes=dynamic,
            opset_version=OPSET, do_constant_folding=True, dynamo=False,
        )
    _pin_shapes(tmp, model)
    os.replace(tmp, path)  # never leave a half-written model where Triton would load it


def _pin_shapes(path: Path, model: S.ModelSpec) -> None:
    """Write the spec's fixed dims into the graph's inputs and outputs.

    The exporter leaves some output axes symbolic (e.g. ``DivEMBEDDING_dim_1`` after the L2
    normalisation); the spec knows them, and a fully declared signature lets the load-time check
    and TensorRT's shape profiles rely on it. Only the batch axis stays symbolic.
    """
    import onnx

    proto = onnx.load(str(path))
    declared = {t.name: t for t in (*model.inputs, *model.outputs)}
    for value in (*proto.graph.input, *proto.graph.output):
        dims = value.type.tensor_type.shape.dim
        fixed = declared[value.name].dims
        if len(dims) != len(fixed) + 1:
            raise ValueError(f"{model.name}: '{value.name}' has rank {len(dims)}, "
                             f"spec says {len(fixed) + 1} (with batch)")
        dims[0].dim_param = "batch"
        for dim, size in zip(dims[1:], fixed):
            dim.dim_value = size
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


def export_all(repository: Path, size: str, force: bool = False) -> list[str]:
    """Export every ONNX model unless the stamp says they are current; return what was exported."""
    stamp_path = repository / STAMP
    wanted = fingerprint(size)
    paths = {m.name: onnx_path(repository, m) for m in S.ONNX_MODELS}
    if not force and stamp_path.exists() and all(p.exists() for p in paths.values()):
        if json.loads(stamp_path.read_text()).get("fingerprint") == wanted:
            return []
    for model in S.ONNX_MODELS:
        started = time.monotonic()
        export_model(model, paths[model.name], size)
        digest = hashlib.sha256(paths[model.name].read_bytes()).hexdigest()[:12]
        print(f"exported {paths[model.name]} ({size}, sha256 {digest}, "
              f"{time.monotonic() - started:.1f} s)", flush=True)
    stamp_path.write_text(json.dumps({"fingerprint": wanted, "size": size}, indent=2) + "\n")
    return [m.name for m in S.ONNX_MODELS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export the repository's ONNX models.")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--size", choices=("small", "full", "fast"),
                        default=os.environ.get("MODEL_SIZE", "small"),
                        help="network size (default: $MODEL_SIZE or 'small')")
    parser.add_argument("--force", action="store_true", help="export even if up to date")
    args = parser.parse_args(argv)
    exported = export_all(args.repository, args.size, args.force)
    if not exported:
        print(f"ONNX models in {args.repository} are up to date ({args.size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
