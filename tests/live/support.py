"""Helpers shared by the live tests: timed requests, status codes, metrics, stub processes."""

from __future__ import annotations

import os
import re
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from bls_models.metrics import FLUSH_SECONDS
from modelgen import configs, export, nets
from tritonlocal import ServerOptions
from tritonlocal.runtime import free_ports

# Triton error code -> what each protocol's client reports.
STATUS = {
    "http": {"INVALID_ARG": "400", "UNAVAILABLE": "503", "INTERNAL": "500", "CANCELLED": "499"},
    "grpc": {"INVALID_ARG": "StatusCode.INVALID_ARGUMENT", "UNAVAILABLE": "StatusCode.UNAVAILABLE",
             "INTERNAL": "StatusCode.INTERNAL", "CANCELLED": "StatusCode.CANCELLED"},
}


def server_options(repository: Path, tmp_path: Path, **kw) -> ServerOptions:
    """Options for one more server: free ports, its log in ``tmp_path``."""
    http, grpc, metrics = free_ports(3)
    return ServerOptions(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                         log_file=tmp_path / "server.log", **kw)


def make_repository(target: Path, source: Path, *models: S.ModelSpec, onnx_from=None) -> Path:
    """A repository holding ``models`` (configs rendered from their specs, ONNX files copied)."""
    onnx_from = onnx_from or {}
    for model in models:
        (target / model.name / "1").mkdir(parents=True)
        (target / model.name / "config.pbtxt").write_text(configs.render(model))
        donor = onnx_from.get(model.name, model)
        if donor is not None:
            shutil.copy(export.onnx_path(source, donor), export.onnx_path(target, model))
    return target


@dataclass
class Outcome:
    elapsed: float
    result: object = None
    error: InferenceServerException | None = None


def image(seed: int = 0, batch: int = 1) -> np.ndarray:
    return nets.synthetic_images(batch, seed=seed).numpy()


def request_inputs(module, name: str, data: np.ndarray, dtype: str):
    tensor = module.InferInput(name, list(data.shape), dtype)
    tensor.set_data_from_numpy(data)
    return [tensor]


def timed_infer(client, protocol: str, model: str, data: np.ndarray, *, name: str = "IMAGE",
                dtype: str = "UINT8", request_id: str = "", timeout_us: int | None = None,
                **kwargs) -> Outcome:
    module = httpclient if protocol == "http" else grpcclient
    inputs = request_inputs(module, name, data, dtype)
    if timeout_us is not None:
        kwargs["timeout"] = timeout_us
    started = time.monotonic()
    try:
        result = client.infer(model, inputs, request_id=request_id, **kwargs)
        return Outcome(time.monotonic() - started, result=result)
    except InferenceServerException as error:
        return Outcome(time.monotonic() - started, error=error)


def metrics_text(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return response.read().decode()


def metric(server, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when absent).

    Waits first for the orchestrators to publish their counters and gauges (every
    ``FLUSH_SECONDS``), so what happened before the call is counted."""
    time.sleep(FLUSH_SECONDS + 0.15)
    total = 0.0
    for line in metrics_text(server).splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def inference_count(client, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"]
    return sum(int(s.get("inference_count", 0)) for s in stats)


def stub_pids(server, model: str) -> list[int]:
    return server.stub_pids(model)


def memory(pid: int) -> dict[str, float]:
    """MiB of a stub: ``private`` (RssAnon, its own heap) and ``region`` (the size of its python
    backend shared-memory region in /dev/shm, a pool that grows with the peak of concurrent
    tensors and never shrinks)."""
    with open(f"/proc/{pid}/status") as handle:
        fields = dict(line.split(":", 1) for line in handle if ":" in line)
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        region = handle.read().split(b"\0")[2].decode()  # argv[2]: the region's name
    return {"private": int(fields["RssAnon"].split()[0]) / 1024,
            "region": os.path.getsize(f"/dev/shm/{region}") / 2**20}


async def drive(url: str, model: str, count: int, concurrency: int, data: np.ndarray,
                name: str = "IMAGE", dtype: str = "UINT8", prefix: str = "load",
                timeout_us: int = 120_000_000) -> list[tuple[str, str | None, Exception | None]]:
    """Send ``count`` requests with at most ``concurrency`` in flight (asyncio gRPC client).

    Returns (request id sent, request id answered or None, error or None) for every request.
    """
    import asyncio

    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int):
        request_id = f"{prefix}-{i}"
        async with slots:
            try:
                result = await client.infer(model, request_inputs(grpcaio, name, data, dtype),
                                            request_id=request_id, timeout=timeout_us)
                return request_id, result.get_response().id, None
            except Exception as error:  # noqa: BLE001 - reported to the caller
                return request_id, None, error

    try:
        return await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        await client.close()
