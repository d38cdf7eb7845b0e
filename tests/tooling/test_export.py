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
        expected = nets.build(model.name)(example)
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = session.run([t.name for t in model.outputs], {model.inputs[0].name: example.numpy()})
    for output, got, want in zip(model.outputs, actual, expected):
        assert got.shape == (3, *output.dims)
        assert got.dtype == np.dtype(S.DTYPES[output.dtype])
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4, err_msg=output.name)


def test_tagger_tags_is_the_tagger_reduced_in_its_graph(repository):
    """Same weights as the tagger; its outputs are what the orchestrator's reduction computes."""
    from bls_models import pipelines

    tokens = nets.example_input(S.TAGGER, batch=2).numpy()
    (logits,) = ort.InferenceSession(str(export.onnx_path(repository, S.TAGGER)),
                                     providers=["CPUExecutionProvider"]).run(None, {"TOKENS": tokens})
    tags, probs = ort.InferenceSession(str(export.onnx_path(repository, S.TAGGER_TAGS)),
                                       providers=["CPUExecutionProvider"]).run(
        ["TAGS", "TAG_PROBS"], {"TOKENS": tokens})
    expected_tags, expected_probs = pipelines.reduce_tags(logits)
    np.testing.assert_array_equal(tags, expected_tags)
    np.testing.assert_allclose(probs, expected_probs, rtol=1e-5, atol=1e-7)


def test_preprocess_is_imagenet_normalisation(repository):
    session = ort.InferenceSession(str(export.onnx_path(repository, S.PREPROCESS)),
                                   providers=["CPUExecutionProvider"])
    image = np.random.default_rng(7).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    (pixels,) = session.run(None, {"IMAGE": image})
    mean, std = np.array(S.IMAGENET_MEAN), np.array(S.IMAGENET_STD)
    expected = ((image / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(pixels, expected, rtol=1e-5, atol=1e-5)


def test_outputs_depend_on_the_image(repository):
    """Random weights, but not a constant function: different images, different answers."""
    pixels = nets.example_input(S.CLASSIFIER, batch=4).numpy()
    classifier = ort.InferenceSession(str(export.onnx_path(repository, S.CLASSIFIER)),
                                      providers=["CPUExecutionProvider"])
    (logits,) = classifier.run(None, {"PIXELS": pixels})
    assert len({tuple(np.argsort(-row)[:5]) for row in logits}) == 4
    embedder = ort.InferenceSession(str(export.onnx_path(repository, S.EMBEDDER)),
                                    providers=["CPUExecutionProvider"])
    (embedding,) = embedder.run(None, {"PIXELS": pixels})
    similarity = embedding @ embedding.T
    assert np.all(similarity[~np.eye(4, dtype=bool)] < 0.95)


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


@pytest.mark.parametrize("model", [S.CLASSIFIER, S.EMBEDDER], ids=lambda m: m.name)
def test_fast_size_keeps_the_contract(tmp_path, model):
    """Size ``fast`` (the proxy for a GPU host, bench/overhead.py): the same tensors in and out as
    the committed model, and answers that depend on the image."""
    path = export.onnx_path(tmp_path, model)
    export.export_model(model, path, "fast")  # checks names and dims against the spec
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pixels = nets.example_input(model, batch=4).numpy()
    (out,) = session.run([model.outputs[0].name], {"PIXELS": pixels})
    assert out.shape == (4, *model.outputs[0].dims)
    assert len({row.tobytes() for row in out}) == 4, "a constant function of the image"
    if model is S.EMBEDDER:
        np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
