"""Pure logic of the local ``onnxruntime`` backend (see ``backends/onnxruntime/model.py``).

Kept apart from the backend's ``model.py`` so it is testable without a server: checking an ONNX
file against a model config, choosing thread counts, and mapping errors. Nothing here imports
``triton_python_backend_utils``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

# Triton config dtype -> (ONNX Runtime type string, numpy dtype)
DTYPES: dict[str, tuple[str, type]] = {
    "TYPE_BOOL": ("tensor(bool)", np.bool_),
    "TYPE_UINT8": ("tensor(uint8)", np.uint8),
    "TYPE_INT8": ("tensor(int8)", np.int8),
    "TYPE_INT16": ("tensor(int16)", np.int16),
    "TYPE_INT32": ("tensor(int32)", np.int32),
    "TYPE_INT64": ("tensor(int64)", np.int64),
    "TYPE_FP16": ("tensor(float16)", np.float16),
    "TYPE_FP32": ("tensor(float)", np.float32),
    "TYPE_FP64": ("tensor(double)", np.float64),
}


@dataclass(frozen=True)
class OnnxTensor:
    """What an ONNX file declares for one input or output (from ``session.get_inputs()``)."""

    name: str
    type: str
    shape: tuple  # ints for fixed axes, str/None for symbolic ones


def mismatches(config: dict, inputs: list[OnnxTensor], outputs: list[OnnxTensor]) -> list[str]:
    """Every way the ONNX file disagrees with the model config, as readable sentences."""
    problems: list[str] = []
    batched = int(config.get("max_batch_size", 0)) > 0
    for kind, declared, actual in (("input", config.get("input", []), inputs),
                                   ("output", config.get("output", []), outputs)):
        by_name = {t.name: t for t in actual}
        wanted_names = {t["name"] for t in declared}
        for extra in sorted(set(by_name) - wanted_names):
            if kind == "input":  # an unused extra output is harmless; an unfed input is not
                problems.append(f"model.onnx has {kind} '{extra}' that config.pbtxt does not declare")
        for tensor in declared:
            name = tensor["name"]
            onnx = by_name.get(name)
            if onnx is None:
                problems.append(f"config.pbtxt declares {kind} '{name}' but model.onnx has "
                                f"{kind}s {sorted(by_name)}")
                continue
            dtype = tensor.get("data_type", "")
            expected_type = DTYPES.get(dtype, (None,))[0]
            if expected_type is None:
                problems.append(f"{kind} '{name}': data type {dtype} is not supported here")
            elif onnx.type != expected_type:
                problems.append(f"{kind} '{name}': config.pbtxt says {dtype} but model.onnx has "
                                f"{onnx.type}")
            dims = [int(d) for d in tensor.get("dims", [])]
            shape = list(onnx.shape)
            if batched:
                if not shape or isinstance(shape[0], int):
                    problems.append(f"{kind} '{name}': max_batch_size > 0 needs a dynamic first "
                                    f"axis in model.onnx, which has shape {shape}")
                    continue
                shape = shape[1:]
            if len(shape) != len(dims) or any(
                isinstance(s, int) and d != -1 and s != d for s, d in zip(shape, dims)
            ):
                problems.append(f"{kind} '{name}': config.pbtxt dims {dims} do not match "
                                f"model.onnx shape {shape} (batch axis excluded)")
    return problems


def instance_count(config: dict) -> int:
    """Total instances of this model on the CPU (what shares this machine's cores)."""
    groups = config.get("instance_group") or [{"count": 1}]
    return max(1, sum(int(g.get("count", 1)) for g in groups))


def thread_counts(config: dict, cpu_count: int | None = None) -> tuple[int, int]:
    """(intra_op, inter_op) threads for one instance's ONNX Runtime session.

    The config parameters ``intra_op_thread_count`` / ``inter_op_thread_count`` are the ones
    Triton's real onnxruntime backend reads, so one config means the same in both places. Without
    them, the machine's cores are split between the model's instances, so that N instances
    running at once do not oversubscribe the cores (ORT's default is one thread per core, per
    session).
    """
    params = config.get("parameters") or {}

    def param(key: str) -> int | None:
        value = (params.get(key) or {}).get("string_value")
        return int(value) if value not in (None, "", "0") else None

    cores = cpu_count or os.cpu_count() or 1
    intra = param("intra_op_thread_count") or max(1, cores // instance_count(config))
    inter = param("inter_op_thread_count") or 1
    return intra, inter


def split_rows(array: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Split a batched result back into per-request pieces along axis 0."""
    bounds = np.cumsum(sizes)[:-1]
    return np.split(array, bounds, axis=0)


def is_invalid_argument(error: BaseException) -> bool:
    """Whether ONNX Runtime rejected the *data* (e.g. an index out of range), not failed itself."""
    return type(error).__name__ in ("InvalidArgument", "INVALID_ARGUMENT") or (
        "out of bounds" in str(error) or "out of range" in str(error)
    )
