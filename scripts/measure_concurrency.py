#!/usr/bin/env python3
"""Measure the orchestrator concurrency designs side by side on one local server.

    .venv/bin/python scripts/measure_concurrency.py [--out docs/results/concurrency-designs.csv]

Every design is the same `pipeline` code (bls_models) under a different configuration:

| design             | how requests of one instance overlap                                 |
|--------------------|----------------------------------------------------------------------|
| event_loop x2      | production: execute() returns at once, model-owned loop, senders      |
| event_loop x1      | the same with one instance                                           |
| batch_gather x1    | execute() waits for its batch (= non-decoupled async execute+gather) |
| batch_gather x4    | the same with four instances ("add instances")                       |
| decoupled x1       | decoupled transaction policy, event loop; needs a gRPC stream client  |

Two scenarios per design, all over gRPC (the decoupled design through a bidirectional stream):
- head-of-line: as many requests stuck 1 s in the classifier stage as the design has instances,
  then 50 unrelated requests; their latency (p50/p95/max);
- throughput: 1 000 requests at concurrency 16 and 64 (asyncio client): requests/s and latency.

The classifier stage is the fault stand-in (instant unless told to be slow), preprocess and
embedder are the real ONNX models. Results go to a CSV and a markdown table on stdout. Figures
are from a 2-core machine that also runs the client: compare rows, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bls_models import spec as S  # noqa: E402
from modelgen import nets, variants  # noqa: E402
from tritonlocal import ServerOptions, TritonServer  # noqa: E402
from tritonlocal.runtime import free_ports  # noqa: E402

STAGES = {"preprocess_model": "preprocess", "classifier_model": "fault_classifier",
          "embedder_model": "embedder", "default_deadline_ms": "30000"}


@dataclasses.dataclass(frozen=True)
class Design:
    name: str
    model: str
    instances: int
    mode: str
    decoupled: bool = False


DESIGNS = (
    Design("event_loop x2 (production)", "design_event_loop_2", 2, "event_loop"),
    Design("event_loop x1", "design_event_loop_1", 1, "event_loop"),
    Design("batch_gather x1", "design_batch_gather_1", 1, "batch_gather"),
    Design("batch_gather x4", "design_batch_gather_4", 4, "batch_gather"),
    Design("decoupled x1 (stream only)", "design_decoupled_1", 1, "event_loop", decoupled=True),
)


def design_specs(repository: Path) -> list[S.ModelSpec]:
    return [dataclasses.replace(S.PIPELINE, name=d.model, instance_count=d.instances,
                                decoupled=d.decoupled,
                                parameters={**S.PIPELINE.parameters, **STAGES,
                                            "concurrency_mode": d.mode,
                                            "stage_model_repositories": str(repository)})
            for d in DESIGNS]


def inputs(module, data):
    tensor = module.InferInput("IMAGE", list(data.shape), "UINT8")
    tensor.set_data_from_numpy(data)
    return [tensor]


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


# -- unary gRPC (non-decoupled designs) ----------------------------------------------------------
def head_of_line_unary(url: str, design: Design, data) -> list[float]:
    results: dict[str, float] = {}
    done = threading.Event()
    client = grpcclient.InferenceServerClient(url)
    started: dict[str, float] = {}

    def callback(request_id):
        def on_done(result, error):
            results[request_id] = time.monotonic() - started[request_id]
            if error is not None:
                print(f"  {design.name}: {request_id} failed: {error}", file=sys.stderr)
            if len(results) == design.instances + 50:
                done.set()
        return on_done

    try:
        for i in range(design.instances):
            rid = f"slow-{i};fault_classifier:delay:1000"
            started[rid] = time.monotonic()
            client.async_infer(design.model, inputs(grpcclient, data), callback(rid), request_id=rid)
            time.sleep(0.1)
        for i in range(50):
            rid = f"fast-{i}"
            started[rid] = time.monotonic()
            client.async_infer(design.model, inputs(grpcclient, data), callback(rid), request_id=rid)
        done.wait(120)
    finally:
        client.close()
    return [v for k, v in results.items() if k.startswith("fast")]


async def throughput_unary(url: str, design: Design, data, concurrency: int, count: int):
    client = grpcaio.InferenceServerClient(url)
    slots = asyncio.Semaphore(concurrency)
    latencies, errors = [], 0

    async def one(i):
        nonlocal errors
        async with slots:
            t0 = time.monotonic()
            try:
                await client.infer(design.model, inputs(grpcaio, data), request_id=f"t-{i}")
                latencies.append(time.monotonic() - t0)
            except Exception:  # noqa: BLE001 - counted
                errors += 1

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        await client.close()
    return count / (time.monotonic() - t0), latencies, errors


# -- gRPC stream (the decoupled design) ------------------------------------------------------------
def stream_run(url: str, design: Design, data, request_ids: list[str], pace: dict[str, float],
               concurrency: int | None = None) -> tuple[dict[str, float], int, float]:
    """Send requests over one stream; return (latency by id, errors, wall time)."""
    client = grpcclient.InferenceServerClient(url)
    started, latency = {}, {}
    errors = 0
    finished = threading.Event()
    window = threading.Semaphore(concurrency or len(request_ids))

    def on_response(result, error):
        nonlocal errors
        if error is not None:
            errors += 1
            rid = None
        else:
            rid = result.get_response().id
        if rid is not None and rid in started and rid not in latency:
            latency[rid] = time.monotonic() - started[rid]
        window.release()
        if len(latency) + errors >= len(request_ids):
            finished.set()

    client.start_stream(callback=on_response)
    t0 = time.monotonic()
    try:
        for rid in request_ids:
            window.acquire()
            started[rid] = time.monotonic()
            client.async_stream_infer(design.model, inputs(grpcclient, data), request_id=rid)
            if rid in pace:
                time.sleep(pace[rid])
        finished.wait(180)
    finally:
        client.stop_stream()
        client.close()
    return latency, errors, time.monotonic() - t0


def measure(server: TritonServer, design: Design, data) -> list[dict]:
    url = server.grpc_url
    rows = []
    slow_ids = [f"slow-{i};fault_classifier:delay:1000" for i in range(design.instances)]
    fast_ids = [f"fast-{i}" for i in range(50)]
    if design.decoupled:
        latency, errors, _ = stream_run(url, design, data, slow_ids + fast_ids,
                                        {rid: 0.1 for rid in slow_ids})
        fast = [latency[r] for r in fast_ids if r in latency]
    else:
        fast, errors = head_of_line_unary(url, design, data), 0
    rows.append({"design": design.name, "scenario": "head-of-line (50 fast, slow in flight)",
                 "concurrency": 50, "throughput_rps": "", "p50_ms": percentile(fast, 50) * 1e3,
                 "p95_ms": percentile(fast, 95) * 1e3, "max_ms": max(fast, default=0) * 1e3,
                 "errors": errors + 50 - len(fast)})
    for concurrency in (16, 64):
        count = 1000
        if design.decoupled:
            ids = [f"t-{i}" for i in range(count)]
            latency, errors, wall = stream_run(url, design, data, ids, {}, concurrency)
            values, rate = list(latency.values()), count / wall
        else:
            rate, values, errors = asyncio.run(throughput_unary(url, design, data, concurrency, count))
        rows.append({"design": design.name, "scenario": "throughput", "concurrency": concurrency,
                     "throughput_rps": rate, "p50_ms": percentile(values, 50) * 1e3,
                     "p95_ms": percentile(values, 95) * 1e3, "max_ms": max(values, default=0) * 1e3,
                     "errors": errors})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "concurrency-designs.csv")
    args = parser.parse_args()
    repository = ROOT / "model_repository"
    data = nets.synthetic_images(1, seed=1).numpy()
    with tempfile.TemporaryDirectory() as tmp:
        extra = variants.build(Path(tmp) / "designs", repository, variants=design_specs(repository),
                               base_of={d.model: "pipeline" for d in DESIGNS})
        http, grpc, metrics = free_ports(3)
        options = ServerOptions(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                log_file=Path(tmp) / "server.log",
                                extra_args=[f"--model-repository={extra}"])
        with TritonServer(options) as server:
            # Warm up every design (shm regions, ORT sessions) before measuring.
            for design in DESIGNS:
                if not design.decoupled:
                    asyncio.run(throughput_unary(server.grpc_url, design, data, 16, 200))
            rows = []
            for design in DESIGNS:
                print(f"measuring {design.name} ...", file=sys.stderr, flush=True)
                rows += measure(server, design, data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("| design | scenario | concurrency | throughput (req/s) | p50 (ms) | p95 (ms) | max (ms) | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        rate = f"{row['throughput_rps']:.0f}" if row["throughput_rps"] != "" else "-"
        print(f"| {row['design']} | {row['scenario']} | {row['concurrency']} | {rate} | "
              f"{row['p50_ms']:.1f} | {row['p95_ms']:.1f} | {row['max_ms']:.1f} | {row['errors']} |")
    print(f"\nwritten: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
