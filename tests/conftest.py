"""Shared fixtures. Live tests start one real tritonserver per session through the same launcher
that `make serve` uses, on free ports, with its log in the pytest temp directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bls_models import spec as S

ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = ROOT / "model_repository"


@pytest.fixture(scope="session")
def repository() -> Path:
    """The project's model repository with its ONNX models exported (a no-op when current)."""
    from modelgen import export

    missing = [m.name for m in S.ONNX_MODELS if not export.onnx_path(MODEL_REPOSITORY, m).exists()]
    if missing:
        export.export_all(MODEL_REPOSITORY, size="small")
    return MODEL_REPOSITORY


@pytest.fixture(scope="session")
def fault_repository(repository, tmp_path_factory) -> Path:
    """Test-only models (fault stand-ins, orchestrator variants wired to them) and the benchmark's
    variants (so the benchmark smoke tests run against the same server)."""
    from bench import experiments
    from modelgen import variants

    target = variants.build(tmp_path_factory.mktemp("fault_repository"), repository)
    return experiments.write_variants(target, repository)


@pytest.fixture(scope="session")
def server(repository, fault_repository, tmp_path_factory):
    """One server for the live tests: the real repository as committed, plus the fault models."""
    from tritonlocal import ServerOptions, TritonServer
    from tritonlocal.runtime import free_ports

    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    options = ServerOptions(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                            log_file=log, extra_args=[f"--model-repository={fault_repository}"],
                            # The crash test leaves a model whose stub is dead; this Triton build
                            # never unloads it, so a clean exit would wait its full exit timeout.
                            stop_grace=5.0)
    server = TritonServer(options)
    server.start()
    pgid = server.process.pid
    yield server
    server.stop()
    try:
        os.killpg(pgid, 0)
        leftover = True
    except ProcessLookupError:
        leftover = False
    assert not leftover, f"processes of the server's group outlived stop(); log {log}"


@pytest.fixture(scope="session")
def http_client(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, concurrency=8,
                                              connection_timeout=60, network_timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def pytest_collection_modifyitems(items):
    """Everything under tests/live talks to a real server."""
    for item in items:
        if "/live/" in str(item.fspath):
            item.add_marker(pytest.mark.live)
