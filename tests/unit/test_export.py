"""The exported ONNX files compute what the PyTorch networks compute, and exports are deterministic."""

from __future__ import annotations

import hashlib

import numpy as np
import onnxruntime as ort
import pytest
import torch

from bls_models import spec as S
from modelgen import export, nets


@pytest.mark.parametrize("model", S.ONNX_MODELS, ids=lambda m: m.name)
def test_onnxruntime_matches_pytorch(repository, model):
    session = ort.InferenceSession(str(export.onnx_path(repository, model)),
                                   providers=["CPUExecutionProvider"])
    # A batch size the export never saw, to exercise the dynamic batch axis.
    example = nets.example_input(model, batch=3)
    with torch.no_grad():
        expected = nets.build(model.name).eval()(example).numpy()
    (actual,) = session.run(None, {model.inputs[0].name: example.numpy()})
    (output,) = model.outputs
    assert actual.shape == (3, *output.dims)
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_preprocess_is_imagenet_normalisation(repository):
    session = ort.InferenceSession(str(export.onnx_path(repository, S.PREPROCESS)),
                                   providers=["CPUExecutionProvider"])
    image = np.random.default_rng(7).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    (pixels,) = session.run(None, {"IMAGE": image})
    mean, std = np.array(S.IMAGENET_MEAN), np.array(S.IMAGENET_STD)
    expected = ((image / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(pixels, expected, rtol=1e-5, atol=1e-5)


def test_embedding_is_unit_length(repository):
    session = ort.InferenceSession(str(export.onnx_path(repository, S.EMBEDDER)),
                                   providers=["CPUExecutionProvider"])
    (embedding,) = session.run(None, {"PIXELS": nets.example_input(S.EMBEDDER, 4).numpy()})
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, rtol=1e-5)


def test_export_is_deterministic(tmp_path, repository):
    exported = export.export_all(tmp_path, size="small", force=True)
    assert exported == [m.name for m in S.ONNX_MODELS]
    for model in S.ONNX_MODELS:
        again = hashlib.sha256(export.onnx_path(tmp_path, model).read_bytes()).hexdigest()
        first = hashlib.sha256(export.onnx_path(repository, model).read_bytes()).hexdigest()
        assert again == first, f"{model.name}: a second export differs"


def test_export_is_skipped_when_current(tmp_path):
    assert export.export_all(tmp_path, size="small") != []
    assert export.export_all(tmp_path, size="small") == []
    export.onnx_path(tmp_path, S.TAGGER).unlink()
    assert export.export_all(tmp_path, size="small") != [], "a missing file forces an export"


def test_full_size_networks_build():
    # Export of the full variants is for GPU hosts; here we check they construct and run.
    classifier = nets.build("classifier", "full")
    assert sum(p.numel() for p in classifier.parameters()) > 20_000_000  # ResNet-50 class
    with torch.no_grad():
        assert classifier(torch.zeros(1, 3, 224, 224)).shape == (1, S.NUM_CLASSES)
