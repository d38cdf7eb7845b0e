#!/usr/bin/env python3
"""Import, under the image's own python3, what the container will import: run by the Dockerfile
at build time, so an image whose Python cannot import the orchestrators, the entry scripts'
modules or TensorRT's bindings fails to build instead of failing in a pod.

    python3 scripts/check_image.py            # the server image
    python3 scripts/check_image.py --test     # the test image: the server's, and the suite's

What it imports:

* every module of ``bls_models`` (the python backend's stub imports them through the
  orchestrators' model.py) and each orchestrator's model.py itself;
* what ``scripts/container-serve.sh`` runs: ``modelgen.profiles``, ``tritonlocal.flags``,
  ``scripts/build_trt_engines.py``; and the Kubernetes liveness probe, ``tritonlocal.liveness``;
* the third-party packages they need: numpy (< 2 for the r24.10 stub), tritonclient's model
  config protobuf, onnx, and TensorRT's Python bindings (``tensorrt``, else the bare
  ``tensorrt_bindings`` of the ``tensorrt-cu12-bindings`` wheel, over the image's libraries).

Importing needs no GPU. Models that import ``triton_python_backend_utils`` at module level (the
test-only fault and probe models) only exist inside a stub and are compiled, not imported.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVER_MODULES = ("modelgen.profiles", "modelgen.configs", "tritonlocal.flags",
                  "tritonlocal.liveness", "tritonclient.grpc.model_config_pb2", "onnx")
TEST_MODULES = ("bench.repository", "ops.gpu_check", "reliability.accounting", "modelgen.variants",
                "tritonlocal.launcher", "pytest", "onnxruntime", "torch", "tritonclient.http",
                "tritonclient.grpc", "requests")
# Run inside a stub only (they import triton_python_backend_utils at module level).
STUB_ONLY = ("modelgen/fault_model.py", "modelgen/probe_model.py")


def package_modules(package: str) -> list[str]:
    module = importlib.import_module(package)
    return [package, *(f"{package}.{m.name}" for m in pkgutil.walk_packages(module.__path__))]


def import_file(path: Path, name: str) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def tensorrt_version() -> str:
    try:
        import tensorrt as trt
    except ImportError:  # the bare bindings wheel, as scripts/build_trt_engines.py falls back to
        import tensorrt_bindings as trt
    return trt.__version__


def check(test_image: bool) -> list[str]:
    """What was imported; raises on the first failure (with the import's own error). The project's
    packages come from where pip installed them, as the stub finds them."""
    done = []
    for name in (*package_modules("bls_models"), *SERVER_MODULES,
                 *(TEST_MODULES if test_image else ())):
        importlib.import_module(name)
        done.append(name)
    for model_py in sorted((ROOT / "model_repository").glob("*/1/model.py")):
        import_file(model_py, f"model_{model_py.parent.parent.name}")
        done.append(str(model_py.relative_to(ROOT)))
    import_file(ROOT / "scripts" / "build_trt_engines.py", "build_trt_engines")
    done.append("scripts/build_trt_engines.py")
    for path in STUB_ONLY:
        compile((ROOT / path).read_text(), path, "exec")  # a SyntaxError fails the build
        done.append(f"{path} (compiled)")

    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise SystemExit(f"numpy {numpy.__version__}: the r24.10 python backend stub needs numpy < 2")
    done.append(f"TensorRT {tensorrt_version()}")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test", action="store_true", help="also what the test image imports")
    args = parser.parse_args(argv)
    done = check(args.test)
    print(f"python {sys.version.split()[0]}: imported {len(done)}: {', '.join(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
