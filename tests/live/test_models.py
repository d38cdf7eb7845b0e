"""Each ONNX model answers over HTTP and gRPC with the shapes, dtypes and values that in-process ONNX
Runtime gives on the same file (Triton's onnxruntime backend runs the same ONNX Runtime library:
equal up to ``support.batch_spread``, which is zero here)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bls_models import spec as S
from modelgen import export
from tests.helpers import assert_served, batch_spread


def random_input(model: S.ModelSpec, batch: int, seed: int) -> np.ndarray:
    (tensor,) = model.inputs
    rng = np.random.default_rng(seed)
    shape = (batch, *tensor.dims)
    if tensor.dtype == "TYPE_UINT8":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if tensor.dtype == "TYPE_INT64":
        return rng.integers(0, S.TAGGER_VOCAB, shape, dtype=np.int64)
    return rng.standard_normal(shape, dtype=np.float32)


@pytest.fixture(scope="module")
def reference(repository):
    sessions = {}

    def run(model: S.ModelSpec, data: np.ndarray) -> np.ndarray:
        if model.name not in sessions:
            sessions[model.name] = ort.InferenceSession(
                str(export.onnx_path(repository, model)), providers=["CPUExecutionProvider"])
        return sessions[model.name].run([t.name for t in model.outputs],
                                        {model.inputs[0].name: data})

    return run


def infer(client, module, model: S.ModelSpec, data: np.ndarray):
    (tensor,) = model.inputs
    dtype = tensor.dtype.removeprefix("TYPE_")
    infer_input = module.InferInput(tensor.name, list(data.shape), dtype)
    infer_input.set_data_from_numpy(data)
    outputs = [module.InferRequestedOutput(t.name) for t in model.outputs]
    return client.infer(model.name, [infer_input], outputs=outputs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", S.ONNX_MODELS, ids=lambda m: m.name)
def test_model_answers_like_onnxruntime(model, protocol, http_client, grpc_client, reference):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    batch = 2
    data = random_input(model, batch, seed=hash((model.name, protocol)) % 1000)
    result = infer(client, module, model, data)
    spreads = batch_spread(lambda d: reference(model, d), data, model.max_batch_size)
    for output, expected, spread in zip(model.outputs, reference(model, data), spreads):
        actual = result.as_numpy(output.name)
        assert actual.shape == (batch, *output.dims)
        assert actual.dtype == np.dtype(S.DTYPES[output.dtype])
        assert_served(actual, expected, spread, output.name)


@pytest.mark.parametrize("model", S.ONNX_MODELS, ids=lambda m: m.name)
def test_metadata_matches_the_spec(model, http_client):
    meta = http_client.get_model_metadata(model.name)
    assert [t["name"] for t in meta["inputs"]] == [t.name for t in model.inputs]
    assert [t["name"] for t in meta["outputs"]] == [t.name for t in model.outputs]
    assert meta["outputs"][0]["shape"] == [-1, *model.outputs[0].dims]
    assert http_client.is_model_ready(model.name)


def test_concurrent_requests_each_get_their_own_answer(http_client, reference):
    """Many requests in flight at once are batched by the server; each must get its own rows."""
    model = S.CLASSIFIER
    inputs = [random_input(model, 1 + i % 3, seed=100 + i) for i in range(24)]
    pending = []
    for data in inputs:
        infer_input = httpclient.InferInput("PIXELS", list(data.shape), "FP32")
        infer_input.set_data_from_numpy(data)
        pending.append(http_client.async_infer(model.name, [infer_input]))
    for data, request in zip(inputs, pending):
        actual = request.get_result().as_numpy("LOGITS")
        (spread,) = batch_spread(lambda d: reference(model, d), data, model.max_batch_size)
        assert_served(actual, reference(model, data)[0], spread, "LOGITS")


def test_batch_above_max_batch_size_is_rejected(http_client):
    model = S.TAGGER
    data = random_input(model, model.max_batch_size + 1, seed=1)
    with pytest.raises(Exception, match="batch"):
        infer(http_client, httpclient, model, data)
    # ... and the server carries on.
    assert infer(http_client, httpclient, model, data[:1]).as_numpy("LOGITS").shape[0] == 1
