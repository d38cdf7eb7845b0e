"""Fixtures of the live tests."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from bls_models import spec as S
from modelgen import export


@pytest.fixture(scope="module")
def onnx(repository):
    """``onnx(model, **feeds)``: the model's outputs from in-process ONNX Runtime over the same
    exported file the server serves."""
    sessions = {m.name: ort.InferenceSession(str(export.onnx_path(repository, m)),
                                             providers=["CPUExecutionProvider"])
                for m in S.ONNX_MODELS}

    def run(model: str, **feeds):
        return sessions[model].run(None, feeds)

    return run


@pytest.fixture
def client_for(http_client, grpc_client):
    """``client_for(protocol)``: the session's HTTP or gRPC client."""
    return lambda protocol: http_client if protocol == "http" else grpc_client
