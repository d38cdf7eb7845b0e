"""The orchestrator concurrency designs, measured side by side on one local server.

    .venv/bin/python -m bench --experiment designs      (or: make bench-designs)

Every design answers `pipeline`'s contract:

| design | how requests of one instance overlap |
|---|---|
| runtime x2 (production) | `execute` answers its whole batch (a request whose deadline passes |
| | first is sent its answer meanwhile); one batch at a time per instance |
| minimal per-batch x2, x4 | `execute` waits for its whole batch (bench/models/minimal.py: the anchor) |
| naive x2 | Triton's BLS example: `async def execute`, `async_exec` per request (bench/models/naive.py) |

Two scenarios per design:
- head-of-line: as many requests stuck 1 s in the classifier stage as the design has instances,
  then 50 unrelated requests; their latency (p50/p95/max);
- throughput: perf_analyzer (gRPC, --async) at the experiment's concurrencies.

The classifier stage is the fault stand-in (instant unless told to be slow), preprocess and
embedder are the real ONNX models.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench import anchors, clients, perf
from bench.common import Context, Result
from modelgen import nets

STAGES = {"preprocess_model": "preprocess", "classifier_model": "fault_classifier",
          "embedder_model": "embedder", "default_deadline_ms": "30000"}


@dataclasses.dataclass(frozen=True)
class Design:
    name: str
    model: str
    instances: int
    source: Path | None = None  # its model.py; None: the runtime's


DESIGNS = (
    Design("runtime x2 (production)", "design_runtime_2", 2),
    Design("minimal per-batch x2", "design_minimal_2", 2, anchors.MINIMAL),
    Design("minimal per-batch x4", "design_minimal_4", 4, anchors.MINIMAL),
    Design("naive async_exec per request x2", "design_naive_2", 2, anchors.NAIVE),
)


def write_designs(target: Path, repository: Path) -> None:
    for design in DESIGNS:
        anchors.write(target, anchors.like_pipeline(
            design.model, design.instances, **STAGES, stage_model_repositories=str(repository)),
            design.source)


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


def head_of_line(url: str, design: Design, data) -> tuple[list[float], int]:
    """Latencies (s) of 50 requests sent while ``design.instances`` requests are stuck 1 s in the
    classifier stage, and how many of the 50 got no answer."""
    fast = head_of_line_unary(url, design, data)
    return fast, 50 - len(fast)


# -- the experiment ------------------------------------------------------------------------------
# Head-of-line rounds per design, interleaved: one round is a few hundred milliseconds and moves by
# 2x between runs on this shared host.
HOL_ROUNDS = 6


def concurrency_designs(ctx: Context) -> Result:
    result = Result("designs", "Orchestrator concurrency designs")
    levels = [1, 4] if ctx.quick else [1, 16, 64, 256]
    rounds = 1 if ctx.quick else HOL_ROUNDS
    url = ctx.server.grpc_url
    image = nets.synthetic_images(1, seed=1).numpy()
    table = [f"| design | 50 requests behind slow ones: p50 / max (ms), median of {rounds} "
             "round(s) | unanswered | "
             + " | ".join(f"req/s (p95 ms), concurrency {c}" for c in levels) + " |",
             "|---|---|---|" + "---|" * len(levels)]
    failures = []
    # Warm-up, unmeasured: 50 requests through every design twice, so that no design pays the
    # server's first requests (ONNX Runtime's first run of each batch size, thread pools, the
    # runtime's record of batch times) for the others. Each design's first round measured cold
    # otherwise, and the first design measured took 2-5x longer than later rounds of itself.
    for _ in range(1 if ctx.quick else 2):
        for design in DESIGNS:
            head_of_line(url, dataclasses.replace(design, instances=0), image)
    hol_rounds: dict[str, list[tuple[list[float], int]]] = {d.name: [] for d in DESIGNS}
    for _ in range(rounds):
        for design in DESIGNS:
            hol_rounds[design.name].append(head_of_line(url, design, image))
    for design in DESIGNS:
        measured = hol_rounds[design.name]
        fast = [latency for latencies, _ in measured for latency in latencies]
        missing = sum(lost for _, lost in measured)
        result.add(design.name, clients.point(50, fast, 1.0), errors=missing,
                   scenario="head-of-line")
        p50 = float(np.median([np.percentile(lat, 50) * 1e3 if lat else np.nan
                               for lat, _ in measured]))
        worst = float(np.median([max(lat, default=0) * 1e3 for lat, _ in measured]))
        run = perf.run(design.model, url, levels, ctx.settings, extra=["--async"])
        result.commands.append(run.command_line)
        if run.error:
            failures.append(f"- {design.name}: perf_analyzer failed: {run.error}")
        for p in run.points:
            result.add(design.name, p, scenario="throughput")
        cells = [next((f"{p.throughput:.0f} ({p.p95_ms:.0f})" for p in run.points
                       if p.concurrency == c), "unstable") for c in levels]
        table.append(f"| {design.name} | {p50:.0f} / {worst:.0f} "
                     f"| {missing} | " + " | ".join(cells) + " |")
    result.summary += table + [""] + failures
    result.plot = {"kind": "curve", "title": "Designs: throughput vs p95 latency",
                   "filter": {"scenario": "throughput"}}
    return result
