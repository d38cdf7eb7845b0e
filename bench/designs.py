"""The orchestrator concurrency designs, measured side by side on one local server.

    .venv/bin/python -m bench --experiment designs      (or: make bench-designs)

Every design is the same `pipeline` code (bls_models) under a different configuration:

| design             | how requests of one instance overlap                                 |
|--------------------|----------------------------------------------------------------------|
| event_loop x2, coalescing | production: execute() returns at once, model-owned loop, senders; sub-requests of concurrent requests go together |
| event_loop x2      | the same, coalescing off                                             |
| event_loop x1      | the same with one instance                                           |
| batch_gather x1    | execute() waits for its batch (= non-decoupled async execute+gather) |
| batch_gather x4    | the same with four instances ("add instances")                       |
| decoupled x1       | decoupled transaction policy, event loop; needs a gRPC stream client  |

Two scenarios per design (the decoupled design through a gRPC bidirectional stream):
- head-of-line: as many requests stuck 1 s in the classifier stage as the design has instances,
  then 50 unrelated requests; their latency (p50/p95/max);
- throughput: perf_analyzer (gRPC; --streaming for decoupled) at the experiment's concurrencies.

The classifier stage is the fault stand-in (instant unless told to be slow), preprocess and
embedder are the real ONNX models.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from bls_models import spec as S

STAGES = {"preprocess_model": "preprocess", "classifier_model": "fault_classifier",
          "embedder_model": "embedder", "default_deadline_ms": "30000"}


@dataclasses.dataclass(frozen=True)
class Design:
    name: str
    model: str
    instances: int
    mode: str
    decoupled: bool = False
    coalesce: bool = False


DESIGNS = (
    Design("event_loop x2, coalescing (production)", "design_coalesced_2", 2, "event_loop",
           coalesce=True),
    Design("event_loop x2, coalescing off", "design_event_loop_2", 2, "event_loop"),
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
                                            "coalesce": "on" if d.coalesce else "off",
                                            "stage_model_repositories": str(repository)})
            for d in DESIGNS]


def inputs(module, data):
    tensor = module.InferInput("IMAGE", list(data.shape), "UINT8")
    tensor.set_data_from_numpy(data)
    return [tensor]


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


def head_of_line(url: str, design: Design, data) -> tuple[list[float], int]:
    """Latencies (s) of 50 requests sent while ``design.instances`` requests are stuck 1 s in the
    classifier stage, and how many of the 50 got no answer."""
    slow_ids = [f"slow-{i};fault_classifier:delay:1000" for i in range(design.instances)]
    fast_ids = [f"fast-{i}" for i in range(50)]
    if design.decoupled:
        latency, _, _ = stream_run(url, design, data, slow_ids + fast_ids,
                                   {rid: 0.1 for rid in slow_ids})
        fast = [latency[r] for r in fast_ids if r in latency]
    else:
        fast = head_of_line_unary(url, design, data)
    return fast, 50 - len(fast)
