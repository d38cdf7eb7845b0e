"""The local onnxruntime backend's load-time checks and batching helpers (no server)."""

from __future__ import annotations

import numpy as np

from modelgen import configs
from bls_models import spec as S
from tritonlocal import onnx_backend as lib


def config_of(model):
    return configs.config_dict(model)


def onnx_like(model, **overrides):
    """OnnxTensors as ORT would report them for a correct export of ``model``."""
    def tensors(declared):
        return [lib.OnnxTensor(t.name, lib.DTYPES[t.dtype][0], ("batch", *t.dims))
                for t in declared]
    return tensors(model.inputs), tensors(model.outputs)


def test_a_correct_export_has_no_mismatch():
    for model in S.ONNX_MODELS:
        assert lib.mismatches(config_of(model), *onnx_like(model)) == []


def test_wrong_input_name_is_named():
    inputs, outputs = onnx_like(S.CLASSIFIER)
    inputs = [lib.OnnxTensor("input.1", inputs[0].type, inputs[0].shape)]
    problems = lib.mismatches(config_of(S.CLASSIFIER), inputs, outputs)
    assert any("'PIXELS'" in p and "input.1" in p for p in problems)
    assert any("'input.1'" in p and "does not declare" in p for p in problems)


def test_wrong_dtype_and_dims_are_reported():
    inputs, outputs = onnx_like(S.TAGGER)
    inputs = [lib.OnnxTensor("TOKENS", "tensor(int32)", ("batch", 256))]
    problems = lib.mismatches(config_of(S.TAGGER), inputs, outputs)
    assert any("TYPE_INT64" in p and "tensor(int32)" in p for p in problems)
    assert any("[512]" in p and "256" in p for p in problems)


def test_batched_model_needs_a_dynamic_batch_axis():
    inputs, outputs = onnx_like(S.EMBEDDER)
    outputs = [lib.OnnxTensor("EMBEDDING", "tensor(float)", (1, 256))]
    problems = lib.mismatches(config_of(S.EMBEDDER), inputs, outputs)
    assert any("dynamic first axis" in p for p in problems)


def test_threads_split_cores_between_instances():
    config = config_of(S.CLASSIFIER)
    config["instance_group"] = [{"count": 2, "kind": "KIND_CPU"}]
    assert lib.thread_counts(config, cpu_count=2) == (1, 1)
    assert lib.thread_counts(config, cpu_count=16) == (8, 1)
    config["instance_group"] = [{"count": 3}, {"count": 1}]
    assert lib.thread_counts(config, cpu_count=16) == (4, 1)


def test_thread_parameters_of_the_real_backend_win():
    config = config_of(S.CLASSIFIER)
    config["parameters"] = {"intra_op_thread_count": {"string_value": "3"},
                            "inter_op_thread_count": {"string_value": "2"}}
    assert lib.thread_counts(config, cpu_count=2) == (3, 2)


def test_split_rows_restores_each_request():
    parts = [np.full((n, 2), n) for n in (1, 3, 2)]
    pieces = lib.split_rows(np.concatenate(parts), [1, 3, 2])
    for part, piece in zip(parts, pieces):
        np.testing.assert_array_equal(part, piece)
