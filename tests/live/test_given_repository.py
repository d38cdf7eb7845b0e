"""`make serve MODEL_REPOSITORY=<yours>` serves your repository as it is: nothing is written into
it, and a missing model file stops it, before any server starts, with one line naming the file
(modelgen/export.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from bls_models import spec as S
from modelgen import export
from tests.helpers import EXTERNAL
from tritonlocal.runtime import free_ports

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(bool(EXTERNAL), reason="drives `make serve` on this host"),
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
]


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def their_repository(tmp_path: Path, repository: Path) -> Path:
    """A user's repository: the preprocess model's config and their own model.onnx (here the
    bytes of the project's, copied: any valid file would do)."""
    copy = tmp_path / "theirs"
    (copy / S.PREPROCESS.name / "1").mkdir(parents=True)
    shutil.copy(repository / S.PREPROCESS.name / "config.pbtxt", copy / S.PREPROCESS.name)
    shutil.copy(export.onnx_path(repository, S.PREPROCESS), export.onnx_path(copy, S.PREPROCESS))
    return copy


def make_serve(copy: Path, ports: list[int]) -> subprocess.Popen:
    return subprocess.Popen(
        ["make", "--no-print-directory", "serve", f"MODEL_REPOSITORY={copy}",
         f"HTTP_PORT={ports[0]}", f"GRPC_PORT={ports[1]}", f"METRICS_PORT={ports[2]}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_make_serve_leaves_every_file_of_a_given_repository_as_it_was(tmp_path, repository):
    copy = their_repository(tmp_path, repository)
    before = snapshot(copy)
    ports = free_ports(3)
    serve = make_serve(copy, ports)
    try:
        give_up = time.monotonic() + 240
        while not ready(ports[0]):
            assert serve.poll() is None, f"make serve exited: {serve.communicate()[1][-2000:]}"
            assert time.monotonic() < give_up, "the server did not become ready"
            time.sleep(0.5)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C
            try:
                serve.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.communicate()
    assert snapshot(copy) == before


def test_make_serve_stops_before_starting_when_a_model_file_is_missing(tmp_path, repository):
    copy = their_repository(tmp_path, repository)
    missing = export.onnx_path(copy, S.PREPROCESS)
    missing.unlink()
    before = snapshot(copy)
    ports = free_ports(3)
    serve = make_serve(copy, ports)
    try:
        _, err = serve.communicate(timeout=300)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.communicate()
    assert serve.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("modelgen.export:")]
    assert len(lines) == 1 and str(missing) in lines[0], err
    assert not ready(ports[0])
    assert snapshot(copy) == before
