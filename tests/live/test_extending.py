"""docs/extending.md as written: a user's two-stage pipeline, from its one model.py (taken from the
page) and the page's config command, served by a real tritonserver beside the repository's models,
answering what ONNX Runtime computes in-process."""

from __future__ import annotations

import subprocess

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from modelgen import export
from tests.helpers import EXTENDING_NAME as NAME
from tests.helpers import (
    STATUS,
    assert_served,
    batch_spread,
    eventually,
    extending_checkout,
    image,
    metrics_text,
    page_config_command,
    page_model_py,
    server_options,
    settled,
)
from tritonlocal import LauncherError, TritonServer


@pytest.fixture(scope="module")
def user_server(repository, tmp_path_factory):
    """A user's checkout: the repository's stage models, plus the page's model directory."""
    work = tmp_path_factory.mktemp("extending")
    repo = extending_checkout(work, repository, page_model_py())
    assert (repo / NAME / "config.pbtxt").is_file()
    with TritonServer(server_options(repo, work)) as server:
        yield server


def in_process(repository, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(embedding, classifier logits) of ``images``, with ONNX Runtime in-process."""
    sessions = [ort.InferenceSession(str(export.onnx_path(repository, m)),
                                     providers=["CPUExecutionProvider"])
                for m in (S.PREPROCESS, S.EMBEDDER, S.CLASSIFIER)]
    (pixels,) = sessions[0].run(None, {"IMAGE": images})
    return sessions[1].run(None, {"PIXELS": pixels})[0], sessions[2].run(None, {"PIXELS": pixels})[0]


def rows_computed(client) -> dict[str, int]:
    stats = client.get_inference_statistics(as_json=True)["model_stats"]
    return {s["name"]: int(s.get("inference_count", 0)) for s in stats
            if s["name"] in ("embedder", "classifier")}


@pytest.mark.parametrize("asked", [None, ["EMBEDDING", "NORM"], ["TOP_CLASS"]],
                         ids=["all", "embedding", "top-class"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_pages_pipeline_serves_what_onnxruntime_computes(user_server, repository, protocol,
                                                             asked):
    """Every output asked for equals ONNX Runtime in-process; a stage whose outputs no one
    asked for computes nothing (Triton's statistics)."""
    module = httpclient if protocol == "http" else grpcclient
    url = user_server.http_url if protocol == "http" else user_server.grpc_url
    client = module.InferenceServerClient(url)
    counter = grpcclient.InferenceServerClient(user_server.grpc_url)
    data = image(seed=3, batch=3)
    tensor = module.InferInput("IMAGE", list(data.shape), "UINT8")
    tensor.set_data_from_numpy(data)
    before = rows_computed(counter)
    result = client.infer(NAME, [tensor], outputs=None if asked is None else
                          [module.InferRequestedOutput(name) for name in asked])
    computed = rows_computed(counter)
    expected, logits = in_process(repository, data)
    if asked is None or "EMBEDDING" in asked:
        (spread, _) = batch_spread(lambda d: in_process(repository, d), data, 16)
        assert_served(result.as_numpy("EMBEDDING"), expected, spread, "EMBEDDING")
        norm = result.as_numpy("NORM")
        assert norm.shape == (3, 1) and norm.dtype == np.float32
        np.testing.assert_allclose(norm[:, 0], np.linalg.norm(expected, axis=1), rtol=1e-5)
    if asked is None or "TOP_CLASS" in asked:
        top = result.as_numpy("TOP_CLASS")
        assert top.shape == (3, 1) and top.dtype == np.int64
        np.testing.assert_array_equal(top[:, 0], logits.argmax(axis=1))
    assert computed["embedder"] - before["embedder"] == (0 if asked == ["TOP_CLASS"] else 3)
    assert computed["classifier"] - before["classifier"] == (
        3 if asked is None or "TOP_CLASS" in asked else 0)


def test_the_pages_pipeline_gets_the_runtimes_errors_and_metrics(user_server):
    client = grpcclient.InferenceServerClient(user_server.grpc_url)
    late = grpcclient.InferInput("IMAGE", [1, 224, 224, 3], "UINT8")
    late.set_data_from_numpy(np.zeros((1, 224, 224, 3), np.uint8))
    # 1 µs cannot be met: an UNAVAILABLE answer (from the queue policy or the runtime's deadline),
    # not a hang or a lost request.
    with pytest.raises(InferenceServerException) as raised:
        client.infer(NAME, [late], client_timeout=30, timeout=1)
    assert raised.value.status() == STATUS["grpc"]["UNAVAILABLE"]
    series = [line for line in metrics_text(user_server).splitlines()
              if line.startswith("bls_deadline_exceeded_total{") and f'model="{NAME}"' in line]
    for stage in ("preprocess", "embedder", "classifier"):  # a series per declared stage
        assert any(f'stage="{stage}"' in line for line in series), series
    before = settled(user_server, "bls_requests_total", model=NAME, code="SUCCESS")
    client.infer(NAME, [late])
    assert eventually(user_server, "bls_requests_total", before + 1, model=NAME,
                      code="SUCCESS") == before + 1


def test_a_parameter_the_pages_pipeline_does_not_accept_fails_its_load(tmp_path):
    """The load-time check of the definition's parameters, in a real server."""
    repo = tmp_path / "model_repository"
    model_py = repo / NAME / "1" / "model.py"
    model_py.parent.mkdir(parents=True)
    model_py.write_text(page_model_py())
    subprocess.run(page_config_command(), cwd=tmp_path, check=True, capture_output=True,
                   timeout=120)
    config = repo / NAME / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "fanout" value { string_value: '
                                           '"sequential" } }\n')
    with pytest.raises(LauncherError) as failure:
        TritonServer(server_options(repo, tmp_path)).start()
    assert NAME in str(failure.value) and "unknown parameter 'fanout'" in str(failure.value)
