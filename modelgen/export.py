"""Export the repository's ONNX models: ``python -m modelgen.export``.

Writes ``<repository>/<model>/1/model.onnx`` for every ONNX model in ``bls_models.spec``, with
the tensor names of the spec and a dynamic batch axis. Exports are deterministic (fixed seeds,
legacy TorchScript exporter), so two runs produce identical files.

A stamp file records a fingerprint of everything an export depends on (this package's sources,
the spec, the model size, the torch version) and the digest of each file written; when the
fingerprint matches and every file exists the export is skipped, so ``make serve`` and
``make test`` can call this unconditionally.

**Only the project's own repository is written to.** ``model_repository/`` of this project gets
the exported models; a model file there that the project did not write (its digest is not the
one the stamp recorded) is never overwritten: the export stops with one line naming it. Any
other repository (``make serve MODEL_REPOSITORY=...``) is served as it is: nothing is written
into it, and if a model it configures for the onnxruntime backend lacks its file, the export
stops, before any server starts, with one line naming the file. ``--into-given`` (``make
models EXPORT_INTO_GIVEN=1``) is the explicit opt-in to export the missing files of the
project's models there — only missing ones, never an existing file.
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
from bls_models.repository import onnx_path

OPSET = 17
STAMP = ".export-stamp.json"
PROJECT_REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
_SOURCES = [Path(__file__).with_name("nets.py"), Path(__file__).with_name("digits.py"),
            Path(__file__), Path(S.__file__)]


def fingerprint(size: str) -> str:
    import torch

    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    digest.update(f"{size}|{torch.__version__}|{OPSET}".encode())
    return digest.hexdigest()


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


class ForeignModelFile(Exception):
    """A model file the project did not write is where an export would write: left alone."""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_project_repository(repository: Path) -> bool:
    return repository.resolve() == PROJECT_REPOSITORY.resolve()


def export_all(repository: Path, size: str, force: bool = False,
               defer: tuple[str, ...] = ()) -> list[str]:
    """Export the ONNX models the stamp does not vouch for (all of them when the fingerprint
    changed, or with ``force``; else those whose file is missing); return what was exported.
    A model named in ``defer`` whose training is not cached is left out (its file removed if
    stale): ``tritonlocal serve`` makes it while the others serve. Raises ForeignModelFile,
    before writing anything, when a file to be replaced is not one the project wrote."""
    stamp_path = repository / STAMP
    wanted = fingerprint(size)
    paths = {m.name: onnx_path(repository, m) for m in S.ONNX_MODELS}
    stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else None
    current = not force and stamp is not None and stamp.get("fingerprint") == wanted
    todo = [m for m in S.ONNX_MODELS if not (current and paths[m.name].exists())]
    for model in todo:
        path = paths[model.name]
        if path.exists() and not _written_here(path, model.name, stamp):
            raise ForeignModelFile(
                f"{path} was not written by this project's export: left as it is (move it away "
                "to have the project's model exported there)")
    later = [m for m in todo if m.name in defer and not _trained(m.name)]
    files = dict(stamp.get("files", {})) if current else {}
    for model in todo:
        path = paths[model.name]
        if model in later:
            path.unlink(missing_ok=True)
            files.pop(model.name, None)
            continue
        started = time.monotonic()
        export_model(model, path, size)
        files[model.name] = _digest(path)
        print(f"exported {path} ({size}, sha256 {files[model.name][:12]}, "
              f"{time.monotonic() - started:.1f} s)", flush=True)
    if todo:
        stamp_path.write_text(json.dumps({"fingerprint": wanted, "size": size, "files": files},
                                         indent=2) + "\n")
    for model in later:
        print(f"{model.name}: deferred (its training is not cached yet); `tritonlocal serve` "
              "makes it while the other models serve", flush=True)
    return [m.name for m in todo if m not in later]


def stamped_size(repository: Path) -> str:
    """The model size ``repository`` was last exported at (its stamp), else the default."""
    try:
        return json.loads((repository / STAMP).read_text())["size"]
    except (OSError, ValueError, KeyError):
        return os.environ.get("MODEL_SIZE", "small")


def _trained(name: str) -> bool:
    """Whether ``name`` needs no training: not a trained model, or its weights are cached."""
    from modelgen import digits

    return name not in digits.MODELS or digits.cached(name)


def _written_here(path: Path, name: str, stamp: dict | None) -> bool:
    """Whether ``path`` is the file the project's last export wrote. A stamp from before digests
    were recorded vouches for the files beside it."""
    if stamp is None:
        return False
    if "files" not in stamp:
        return True
    return stamp["files"].get(name) == _digest(path)


def missing_model_files(repository: Path) -> list[Path]:
    """The model files ``repository``'s onnxruntime models need and lack: for each model
    directory with a config.pbtxt for the onnxruntime backend, its model file
    (``default_model_filename``, else model.onnx) in every version directory (``1/`` when there
    is none)."""
    from bls_models.repository import load_config

    missing = []
    for config_path in sorted(repository.glob("*/config.pbtxt")):
        config = load_config(config_path)
        if config.backend != "onnxruntime" and config.platform != "onnxruntime_onnx":
            continue
        name = config.default_model_filename or "model.onnx"
        versions = [d for d in config_path.parent.iterdir() if d.is_dir() and d.name.isdigit()]
        for version in versions or [config_path.parent / "1"]:
            if not (version / name).exists():
                missing.append(version / name)
    return missing


def export_missing(repository: Path, size: str, missing: list[Path]) -> list[Path]:
    """Export the project's models for ``missing`` files of ``repository`` (the opt-in);
    returns the files it cannot export (not one of the project's models)."""
    models = {m.name: m for m in S.ONNX_MODELS}
    unknown = []
    for path in missing:
        model = models.get(path.parent.parent.name)
        if model is None or path.name != "model.onnx":
            unknown.append(path)
            continue
        export_model(model, path, size)
        print(f"exported {path} ({size}, sha256 {_digest(path)[:12]})", flush=True)
    return unknown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export the repository's ONNX models.")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--size", choices=("small", "full", "fast"),
                        default=os.environ.get("MODEL_SIZE", "small"),
                        help="network size (default: $MODEL_SIZE or 'small')")
    parser.add_argument("--force", action="store_true", help="export even if up to date")
    parser.add_argument("--defer", action="append", default=[], metavar="MODEL",
                        help="leave this model out if it must be trained first (repeatable; "
                             "`make serve`: digits_large, made while the others serve)")
    parser.add_argument("--into-given", action="store_true",
                        help="a repository other than the project's: export the project's "
                             "models whose files are missing there (never an existing file)")
    args = parser.parse_args(argv)
    if not is_project_repository(args.repository):
        return _given(args.repository, args.size, args.into_given)
    try:
        exported = export_all(args.repository, args.size, args.force, tuple(args.defer))
    except ForeignModelFile as refused:
        print(f"modelgen.export: {refused}", file=sys.stderr)
        return 2
    if not exported:
        print(f"ONNX models in {args.repository} are up to date ({args.size})")
    return 0


def _given(repository: Path, size: str, into_given: bool) -> int:
    """A repository the user gave: served as it is; one line and exit 2 if a file is missing."""
    if not repository.is_dir():
        print(f"modelgen.export: {repository} is not a directory", file=sys.stderr)
        return 2
    missing = missing_model_files(repository)
    if missing and into_given:
        missing = export_missing(repository, size, missing)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        print(f"modelgen.export: {missing[0]} is missing{more}; {repository} is served as it is "
              "and nothing is exported into it (EXPORT_INTO_GIVEN=1 exports the project's "
              "models there)", file=sys.stderr)
        return 2
    print(f"{repository}: every model file is present; served as it is (nothing exported)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
