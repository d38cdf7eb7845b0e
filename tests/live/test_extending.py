"""docs/extending.md as written: a user's two-stage pipeline, from its one model.py (taken from the
page) and the page's config command, served by a real tritonserver beside the repository's models,
answering what ONNX Runtime computes in-process."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from modelgen import export
from tests.live.support import (ROOT, STATUS, assert_served, batch_spread, eventually, image,
                                metrics_text, server_options, settled)
from tritonlocal import LauncherError, TritonServer

PAGE = ROOT / "docs" / "extending.md"
NAME = "image_embedding"


def page_model_py() -> str:
    text = PAGE.read_text()
    block = text.split("<!-- extending: model.py -->\n```python\n", 1)[1]
    return block.split("\n```\n", 1)[0] + "\n"


def page_config_command() -> list[str]:
    """The page's `python -m modelgen.configs --pipeline ...` command, run with this Python."""
    match = re.search(r"^\.venv/bin/python (-m modelgen\.configs --pipeline \S+)$", PAGE.read_text(),
                      re.MULTILINE)
    assert match, "docs/extending.md lost its config command"
    return [sys.executable, *shlex.split(match.group(1))]


@pytest.fixture(scope="module")
def user_server(repository, tmp_path_factory):
    """A user's checkout: the repository's stage models, plus the page's model directory."""
    work = tmp_path_factory.mktemp("extending")
    repo = work / "model_repository"
    repo.mkdir()
    for stage_model in (S.PREPROCESS, S.EMBEDDER):
        (repo / stage_model.name).symlink_to(repository / stage_model.name)
    model_py = repo / NAME / "1" / "model.py"
    model_py.parent.mkdir(parents=True)
    model_py.write_text(page_model_py())
    written = subprocess.run(page_config_command(), cwd=work, capture_output=True, text=True,
                             timeout=120)
    assert written.returncode == 0, written.stderr
    assert (repo / NAME / "config.pbtxt").is_file()
    with TritonServer(server_options(repo, work)) as server:
        yield server


def embed_in_process(repository, images: np.ndarray) -> tuple[np.ndarray]:
    sessions = [ort.InferenceSession(str(export.onnx_path(repository, m)),
                                     providers=["CPUExecutionProvider"])
                for m in (S.PREPROCESS, S.EMBEDDER)]
    (pixels,) = sessions[0].run(None, {"IMAGE": images})
    return tuple(sessions[1].run(None, {"PIXELS": pixels}))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_pages_pipeline_serves_what_onnxruntime_computes(user_server, repository, protocol):
    module = httpclient if protocol == "http" else grpcclient
    url = user_server.http_url if protocol == "http" else user_server.grpc_url
    client = module.InferenceServerClient(url)
    data = image(seed=3, batch=3)
    tensor = module.InferInput("IMAGE", list(data.shape), "UINT8")
    tensor.set_data_from_numpy(data)
    result = client.infer(NAME, [tensor])
    (expected,) = embed_in_process(repository, data)
    (spread,) = batch_spread(lambda d: embed_in_process(repository, d), data, 16)
    assert_served(result.as_numpy("EMBEDDING"), expected, spread, "EMBEDDING")
    norm = result.as_numpy("NORM")
    assert norm.shape == (3, 1) and norm.dtype == np.float32
    np.testing.assert_allclose(norm[:, 0], np.linalg.norm(expected, axis=1), rtol=1e-5)


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
    for stage in ("preprocess", "embedder"):  # a series per declared stage
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
