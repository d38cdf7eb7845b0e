"""Test-only ONNX models with the classifier's or the embedder's contract that fail their whole
batch on one bad item.

Triton's onnxruntime backend runs each dynamic batch as one ONNX Runtime call, so an error that
depends on the *values* of one request fails every request batched with it. These models make
that reproducible: they answer like a (trivial) classifier, PIXELS -> LOGITS, or embedder,
PIXELS -> EMBEDDING, unless an item is **poisoned**, and then ONNX Runtime fails the whole call
(a ``Gather`` index out of bounds, an ``INVALID_ARGUMENT`` from ONNX Runtime).

An item is poisoned when its top-left pixel is magenta in the image it came from, RGB
(255, 0, 255), after the pipeline's ImageNet normalisation: PIXELS[:, 0, 0, 0] > 2.2,
PIXELS[:, 1, 0, 0] < -2.0 and PIXELS[:, 2, 0, 0] > 2.6. A client can therefore poison a request
through ``pipeline`` (``poison_image``), and a random image is poisoned with probability 2^-24.
The graph is built with ``onnx.helper`` (no weights beyond a fixed projection): deterministic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bls_models import spec as S

POISON_RGB = (255, 0, 255)
# Normalised values of 255 / 0 / 255 are 2.249, -2.036 and 2.640; the thresholds sit just inside.
_THRESHOLDS = ((0, "Greater", 2.2), (1, "Less", -2.0), (2, "Greater", 2.6))
OUT_OF_BOUNDS = 7  # the Gather index a poisoned item produces (its table has 2 entries)


def poison_image(image: np.ndarray) -> np.ndarray:
    """A copy of an IMAGE batch (N, H, W, 3) uint8 whose first item is poisoned."""
    poisoned = image.copy()
    poisoned[0, 0, 0, :] = POISON_RGB
    return poisoned


def poison_pixels(pixels: np.ndarray) -> np.ndarray:
    """A copy of a PIXELS batch (N, 3, H, W) float32 whose first item is poisoned."""
    poisoned = pixels.copy()
    for channel, value in enumerate(POISON_RGB):
        poisoned[0, channel, 0, 0] = (value / 255.0 - S.IMAGENET_MEAN[channel]) / S.IMAGENET_STD[channel]
    return poisoned


def is_poisoned(pixels: np.ndarray) -> np.ndarray:
    """Per item of a PIXELS batch: would the model fail on it? (The graph's own condition.)"""
    flags = np.ones(pixels.shape[0], dtype=bool)
    for channel, op, threshold in _THRESHOLDS:
        values = pixels[:, channel, 0, 0]
        flags &= values > threshold if op == "Greater" else values < threshold
    return flags


def reference(pixels: np.ndarray, output: S.TensorSpec = S.CLASS_LOGITS) -> np.ndarray:
    """The output of an unpoisoned batch, as the graph computes it: channel means projected."""
    return pixels.mean(axis=(2, 3)) @ _projection(output)


def _projection(output: S.TensorSpec) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((3, output.dims[0])).astype(np.float32)


def build(output: S.TensorSpec = S.CLASS_LOGITS):
    """The model with PIXELS in and ``output`` (LOGITS or EMBEDDING) out."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    pixels, logits = S.PIXELS, output
    nodes, inits = [], [
        numpy_helper.from_array(np.array([0, 0, 0], np.int64), "corner_start"),
        numpy_helper.from_array(np.array([3, 1, 1], np.int64), "corner_end"),
        numpy_helper.from_array(np.array([1, 2, 3], np.int64), "corner_axes"),
        numpy_helper.from_array(np.array([-1, 3], np.int64), "corner_shape"),
        numpy_helper.from_array(np.array([0.0, 0.0], np.float32), "table"),
        numpy_helper.from_array(np.array(OUT_OF_BOUNDS, np.int64), "bad_index"),
        numpy_helper.from_array(np.array([2, 3], np.int64), "spatial_axes"),
        numpy_helper.from_array(_projection(output), "projection"),
    ]
    # The top-left pixel of every item, (N, 3).
    nodes += [helper.make_node("Slice", [pixels.name, "corner_start", "corner_end", "corner_axes"],
                               ["corner4"]),
              helper.make_node("Reshape", ["corner4", "corner_shape"], ["corner"])]
    flags = []
    for channel, op, threshold in _THRESHOLDS:
        inits += [numpy_helper.from_array(np.array([channel], np.int64), f"ch{channel}"),
                  numpy_helper.from_array(np.array(threshold, np.float32), f"th{channel}")]
        nodes += [helper.make_node("Gather", ["corner", f"ch{channel}"], [f"v{channel}"], axis=1),
                  helper.make_node(op, [f"v{channel}", f"th{channel}"], [f"f{channel}"])]
        flags.append(f"f{channel}")
    nodes += [helper.make_node("And", flags[:2], ["f01"]),
              helper.make_node("And", ["f01", flags[2]], ["poisoned2d"]),  # (N, 1)
              helper.make_node("Cast", ["poisoned2d"], ["poisoned_i"], to=TensorProto.INT64),
              helper.make_node("Mul", ["poisoned_i", "bad_index"], ["index"]),
              # Out of bounds for a poisoned item: ONNX Runtime fails the whole call.
              helper.make_node("Gather", ["table", "index"], ["offset"], axis=0),  # (N, 1)
              helper.make_node("ReduceMean", [pixels.name, "spatial_axes"], ["means"], keepdims=0),
              helper.make_node("MatMul", ["means", "projection"], ["projected"]),
              helper.make_node("Add", ["projected", "offset"], [logits.name])]
    graph = helper.make_graph(
        nodes, "poison_classifier",
        [helper.make_tensor_value_info(pixels.name, TensorProto.FLOAT, ["batch", *pixels.dims])],
        [helper.make_tensor_value_info(logits.name, TensorProto.FLOAT, ["batch", *logits.dims])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                              producer_name="modelgen.poison")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write(path: Path, output: S.TensorSpec = S.CLASS_LOGITS) -> Path:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(output), str(path))
    return path
