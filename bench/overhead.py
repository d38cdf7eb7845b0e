"""`make bench-overhead`: what serving around the models costs where the models are fast.

On a GPU a sub-model runs in a millisecond or two, and throughput and latency are decided by
what surrounds it: the orchestrator's own Python, the python backend's IPC, tritonserver. The
committed CPU CNNs (about 10 ms per image here) hide that cost. This experiment shows it on a
CPU: the committed repository — every config and the orchestrators' code as committed — with its
ONNX models exported at size ``fast`` (modelgen/nets.py: the classifier and the embedder reduced
to a channel mean and one linear map with the same tensors in and out, preprocess unchanged), in
a directory of its own, served by a server of its own.

Measured, side by side in one run:

- throughput, p50 and p99 at concurrency 1 to 64 of five ways to get the same answer: in-process
  ONNX Runtime, the client calling the sub-models itself (gRPC), the BLS ``pipeline``, the
  plainest per-batch BLS (``pipeline_minimal``, the anchor: bench/models/minimal.py) and
  ``pipeline_ensemble`` (perf_analyzer, gRPC; the served ones level by level, one after the
  other);
- CPU per request of every process (tritonserver, each model's stubs, the load generator) with
  each served way driven at concurrency 16;
- the latency each hop adds at concurrency 1, in µs: one model through Triton against the same
  ONNX Runtime session in-process, and each way of orchestrating against in-process.

The targets are issue 27's, ratios to the anchor measured beside it (``TARGETS``).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import anchors, perf, profile
from bench.common import Context, Result, best_point, point_at, target_line
from bench.perf import Point
from bls_models import spec as S
from modelgen import export, nets
from tritonlocal import TritonServer, on_free_ports

ROOT = Path(__file__).resolve().parents[1]
SIZE = "fast"
LEVELS = (1, 2, 4, 8, 16, 32, 64)
ACCOUNTING_CONCURRENCY = 16
ROUNDS = 9                  # interleaved rounds of the anchor comparison
HOP_REQUESTS = 400          # sequential requests per single-model latency (concurrency 1)
STAGES = (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER)
TARGETS = {  # issue 27
    "throughput": 0.95,      # pipeline / anchor throughput at concurrency 16 and 64: at least
    "p50_over_ms": 0.2,      # pipeline - anchor p50 at concurrency 1: at most
    "stub_cpu": 1.15,        # pipeline / anchor stub CPU per request at concurrency 16: at most
    "ensemble": 0.63,        # pipeline / ensemble best throughput (floor ~0.66): at least
}


SERVED = (*STAGES, S.POSTPROCESS, S.PIPELINE, S.PIPELINE_ENSEMBLE)


def fast_repository(target: Path, repository: Path, size: str = SIZE) -> Path:
    """What ``pipeline`` and ``pipeline_ensemble`` need of ``repository`` — configs and
    orchestrator code as they are there — in ``target`` (a new directory), with the ONNX models
    exported at ``size`` (``committed``: ``repository``'s own ONNX files, copied).
    ``repository`` itself is only read."""
    keep = size == "committed"
    for model in SERVED:
        shutil.copytree(repository / model.name, target / model.name,
                        ignore=shutil.ignore_patterns(*(() if keep else ("*.onnx",)), "*.plan",
                                                      "*.tmp", "__pycache__"))
    for model in SERVED:
        if model.backend == "onnxruntime" and not keep:
            export.export_model(model, export.onnx_path(target, model), size)
    anchors.write_minimal(target, target / "pipeline" / "config.pbtxt")
    return target


def _in_process_stage(local: anchors.InProcess, model: S.ModelSpec, count: int) -> Point:
    """One ONNX Runtime session, ``count`` calls one after another: the work of one hop."""
    (tensor,) = model.inputs
    data = nets.example_input(model, batch=1).numpy()
    session = local.sessions[model.name]
    for _ in range(20):
        session.run(None, {tensor.name: data})
    latencies = []
    started = time.monotonic()
    for _ in range(count):
        sent = time.monotonic()
        session.run(None, {tensor.name: data})
        latencies.append(time.monotonic() - sent)
    return perf.point(1, latencies, time.monotonic() - started)


def sequential_latency(url: str, model: str, inputs: dict[str, np.ndarray], count: int) -> Point:
    """``count`` requests one after another (after a warm-up) on one gRPC client: concurrency 1,
    with no stability criterion to miss (perf_analyzer's failed on the few-ms stages here)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, data in inputs.items():
        tensor = grpcclient.InferInput(name, list(data.shape), np_to_triton_dtype(data.dtype))
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    latencies = []
    try:
        for _ in range(min(20, count)):
            client.infer(model, tensors)
        started = time.monotonic()
        for _ in range(count):
            sent = time.monotonic()
            client.infer(model, tensors)
            latencies.append(time.monotonic() - sent)
        return perf.point(1, latencies, time.monotonic() - started)
    finally:
        client.close()


def overhead(ctx: Context) -> Result:
    result = Result("overhead", "Overhead: the committed pipeline over fast sub-models "
                                "(the proxy for a GPU host)")
    levels = [1] if ctx.quick else list(LEVELS)  # quick: orchestration's smoke has two levels
    seconds = 1.0 if ctx.quick else 6.0
    log = ROOT / ".triton" / f"overhead-tritonserver-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        repository = fast_repository(Path(tmp) / "model_repository", ctx.repository)
        with TritonServer(on_free_ports(repository, log)) as server:
            measure(ctx, result, server, repository, levels, seconds)
    result.summary.append(f"- This experiment's server log: `{log.relative_to(ROOT)}`.")
    result.plot = {"kind": "curve", "title": "Fast sub-models: throughput vs p95 latency",
                   "filter": {"scenario": None}}
    return result


def measure(ctx, result, server: TritonServer, repository: Path | None, levels: list[int],
            seconds: float, rounds: int = ROUNDS) -> None:
    """The experiment against ``server``. ``repository``: where the ONNX files are for the
    in-process comparison on this CPU; None on a GPU host (``make gpu-check``), where the models
    run on the GPU and an in-process CPU run compares nothing."""
    url = server.grpc_url
    local = anchors.InProcess(repository, models=STAGES) if repository else None
    image = nets.synthetic_images(1, seed=5).numpy()
    inproc = ([local.measure(lambda: local.pipeline(image), c, seconds) for c in levels]
              if local else [])
    for p in inproc:
        result.add("in-process onnxruntime", p, protocol="none")
    count = (lambda c: 40) if ctx.quick else (lambda c: max(1000, 150 * c))
    direct = [asyncio.run(anchors.client_pipeline(url, c, count(c))) for c in levels]
    for p in direct:
        result.add("client calls sub-models", p)
    labels = {"in-process": "in-process ONNX Runtime", "direct": "client calls sub-models",
              "bls": "BLS `pipeline`", "minimal": "minimal per-batch BLS (anchor)",
              "ensemble": "`pipeline_ensemble`"}
    served = {"bls": "pipeline", "minimal": "pipeline_minimal", "ensemble": "pipeline_ensemble"}
    runs = perf.interleaved(served, url, levels, ctx.settings)
    ways = {"in-process": inproc, "direct": direct,
            **{key: result.add_run(labels[key], run) for key, run in runs.items()}}
    best = {k: best_point(v) for k, v in ways.items()}
    one = {k: point_at(v, 1) for k, v in ways.items()}
    result.summary += [
        "| way | best throughput (req/s) | at concurrency | p50 / p99 at concurrency 1 (ms) |",
        "|---|---|---|---|",
        *[f"| {labels[k]} | {best[k].throughput:.0f} | {best[k].concurrency} | "
          f"{one[k].p50_ms:.2f} / {one[k].p99_ms:.2f} |" for k in ways if best[k] and one[k]],
    ]
    result.summary += hops(ctx, result, url, local, one)
    result.summary += cpu(ctx, result, server, local, image)
    rounds = 1 if ctx.quick else rounds
    figures = anchors.side_by_side(server, {"bls": "pipeline", "minimal": "pipeline_minimal"},
                                   rounds, levels=(16, 64) if not ctx.quick else (4,),
                                   seconds=1.0 if ctx.quick else 8.0, quick=ctx.quick)
    levels_ = (16, 64) if not ctx.quick else (4,)
    ratio = {c: anchors.paired(figures, "bls", "minimal", f"rps_c{c}") for c in levels_}
    over = [d / 1000 for d in anchors.paired(figures, "bls", "minimal", "p50_c1_us", True)]
    stub = anchors.paired(figures, "bls", "minimal", "stub_cpu_ms")
    ensemble = (best["bls"].throughput / best["ensemble"].throughput
                if best["bls"] and best["ensemble"] else None)
    def med(values):
        return statistics.median(values) if values else None
    result.summary += [
        "", f"Targets (issue 27): `pipeline` against the anchor in {rounds} interleaved "
        "round(s) (order reversed every other round), per round: p50 at concurrency 1 "
        "(perf_analyzer), then 8 s at concurrency 16 (throughput, stub CPU per request) and "
        "64 (throughput); median of the rounds' ratios (range):", "",
        "| figure | `pipeline` | minimal per-batch | ratio or difference |", "|---|---|---|---|",
        *[f"| {label} | {anchors.summary(figures['bls'][k], d)} | "
          f"{anchors.summary(figures['minimal'][k], d)} | {anchors.summary(v, 2)} |"
          for label, k, d, v in (
              ("p50 at concurrency 1 (µs)", "p50_c1_us", 0, over),
              *[(f"req/s at concurrency {c}", f"rps_c{c}", 0, ratio[c]) for c in levels_],
              ("stub CPU ms per request at the first level", "stub_cpu_ms", 3, stub))],
        "",
        *[target_line(f"`pipeline` / minimal per-batch, throughput at concurrency {c}",
                      med(ratio[c]), TARGETS["throughput"], "higher") for c in levels_],
        target_line("`pipeline` − minimal per-batch, p50 at concurrency 1", med(over),
                    TARGETS["p50_over_ms"], "lower", " ms"),
        target_line("`pipeline` / minimal per-batch, stub CPU per request", med(stub),
                    TARGETS["stub_cpu"], "lower"),
        target_line("`pipeline` / ensemble, best throughput of the sweep (three hops: floor "
                    "≈ 0.66)", ensemble, TARGETS["ensemble"], "higher"),
    ]
    anchors.add_rounds(result, figures)
    result.data.update({"throughput_ratio": {c: med(r) for c, r in ratio.items()},
                        "p50_over_anchor_ms": med(over), "stub_cpu_ratio": med(stub),
                        "ensemble_ratio": ensemble,
                        "best": {k: p.throughput for k, p in best.items() if p},
                        "p50_c1_ms": {k: p.p50_ms for k, p in one.items() if p}})


def hops(ctx, result, url: str, local: anchors.InProcess | None, one: dict) -> list[str]:
    """What one hop through Triton adds at concurrency 1: each stage model alone through Triton
    against its session in-process, and each way of orchestrating against in-process."""
    count = 40 if ctx.quick else HOP_REQUESTS
    lines = ["", f"Latency added per hop at concurrency 1 (p50 of {count} sequential requests, "
             "µs): one model through Triton (gRPC) against the same model in-process.", "",
             "| model | in-process (µs) | through Triton (µs) | added (µs) |", "|---|---|---|---|"]
    added = {}
    for model in STAGES:
        alone = _in_process_stage(local, model, count) if local else None
        (tensor,) = model.inputs
        served = sequential_latency(url, model.name, {
            tensor.name: nets.example_input(model, batch=1).numpy()}, count)
        result.add(f"{model.name} alone, through Triton", served, scenario="hop")
        if alone is None:
            lines.append(f"| `{model.name}` | – | {1000 * served.p50_ms:.0f} | – |")
            continue
        result.add(f"{model.name} alone, in-process", alone, scenario="hop")
        added[model.name] = 1000 * (served.p50_ms - alone.p50_ms)
        lines.append(f"| `{model.name}` | {1000 * alone.p50_ms:.0f} | {1000 * served.p50_ms:.0f} "
                     f"| {added[model.name]:.0f} |")
    base = one.get("in-process")
    if base:
        # Hops per request: the client's call, then each model's (the ensemble's four steps,
        # the BLS pipeline's three sub-requests, the client's three calls).
        lines += ["", "| way | p50 at concurrency 1 (µs) | over in-process (µs) | hops | per hop "
                  "(µs) |", "|---|---|---|---|---|"]
        for key, label, count_hops in (("direct", "client calls sub-models", 3),
                                       ("ensemble", "`pipeline_ensemble`", 5),
                                       ("bls", "BLS `pipeline`", 4)):
            p = one.get(key)
            if p:
                extra = 1000 * (p.p50_ms - base.p50_ms)
                lines.append(f"| {label} | {1000 * p.p50_ms:.0f} | {extra:.0f} | {count_hops} | "
                             f"{extra / count_hops:.0f} |")
    result.data["hop_added_us"] = added
    return lines


def cpu(ctx, result, server: TritonServer, local: anchors.InProcess | None,
        image: np.ndarray) -> list[str]:
    """CPU per request of every process, each served way driven alone."""
    concurrency = 4 if ctx.quick else ACCOUNTING_CONCURRENCY
    seconds = 1.0 if ctx.quick else 15.0
    served = (("bls", "pipeline"), ("minimal", "pipeline_minimal"),
              ("ensemble", "pipeline_ensemble"))
    loads = {way: profile.drive(server, model, concurrency, seconds,
                                **anchors.QUICK_DRIVE if ctx.quick else {"warmup": 5})
             for way, model in served}
    columns = {way: load.cpu_ms_per_request() for way, load in loads.items()}
    throughput = {way: load.requests / load.seconds for way, load in loads.items()}
    if local is not None:
        measured, inproc_ms = local.cpu_per_request(lambda: local.pipeline(image), 4, seconds)
        columns["in-process"] = {"in-process (one Python process)": inproc_ms}
        throughput["in-process"] = measured.throughput
    for way, values in columns.items():
        for process, ms in values.items():
            result.rows.append({"experiment": result.name, "variant": f"cpu: {way}",
                                "scenario": "cpu accounting", "process": process,
                                "cpu_ms_per_request": round(ms, 4),
                                "throughput": round(throughput[way], 2)})
    order = [k for k in ("in-process", "bls", "minimal", "ensemble") if k in columns]
    heads = {"in-process": "in-process", "bls": "BLS `pipeline`",
             "minimal": "minimal per-batch BLS", "ensemble": "`pipeline_ensemble`"}
    names = sorted({k for v in columns.values() for k in v},
                   key=lambda k: -max(v.get(k, 0.0) for v in columns.values()))
    lines = ["", f"CPU per request by process (ms), each way driven alone at concurrency "
             f"{concurrency} for {seconds:.0f} s (in-process: 4 threads), from /proc; the ONNX "
             "models run inside tritonserver:", "",
             "| process | " + " | ".join(heads[k] for k in order) + " |",
             "|---|" + "---|" * len(order)]
    for name in names:
        cells = [columns[k].get(name, 0.0) for k in order]
        if max(cells) >= 0.005:
            lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" if c else "–" for c in cells)
                         + " |")
    lines.append("| **total** | " + " | ".join(
        f"**{sum(columns[k].values()):.3f}**" for k in order) + " |")
    lines.append("| throughput in this period (req/s) | " + " | ".join(
        f"{throughput[k]:.0f}" for k in order) + " |")
    result.data["stub_cpu_ms"] = {way: columns[way].get(f"{model} stubs")
                                  for way, model in served if way != "ensemble"}
    result.data["pipeline_stub_cpu_ms"] = result.data["stub_cpu_ms"]["bls"]
    result.data["accounting_concurrency"] = concurrency
    result.data["cpu_ms_per_request"] = columns
    return lines


# -- `python -m bench.overhead`: issue 47's side-by-side ---------------------------------------
QUEUE_POLICY = ("  default_queue_policy {\n    default_timeout_microseconds: 30000000\n"
                "    allow_timeout_override: true\n    max_queue_size: 4096\n  }\n")


def with_queue_policy(repository: Path) -> None:
    """Give every dynamic batcher of ``repository`` the queue policy the committed configs had
    until issue 47 (the stall's cause: Triton 2.51 stops prefetching with one)."""
    for config in repository.glob("*/config.pbtxt"):
        text = config.read_text()
        if "default_queue_policy" not in text:
            config.write_text(text.replace("dynamic_batching {\n",
                                           "dynamic_batching {\n" + QUEUE_POLICY))


def side_by_side_run(repository: Path, size: str, queue_policy: bool, rounds: int,
                     p99_seconds: float) -> dict:
    """`pipeline` and the plainest per-batch BLS on `pipeline`'s config, one server: the
    anchor figures in ``rounds`` interleaved rounds, then each driven ``p99_seconds`` at
    concurrency 16 (perf_analyzer's p99 over three windows)."""
    log = ROOT / ".triton" / f"side-by-side-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as tmp:
        served = fast_repository(Path(tmp) / "model_repository", repository, size)
        if queue_policy:
            with_queue_policy(served)
        with TritonServer(on_free_ports(served, log)) as server:
            models = {"bls": "pipeline", "minimal": "pipeline_minimal"}
            figures = anchors.side_by_side(server, models, rounds, levels=(16,))
            # perf_analyzer reports over its last 3 windows: 3 of p99_seconds / 3 each.
            settings = perf.Settings(window_ms=int(p99_seconds * 1000 / 3), stability=1000,
                                     max_trials=3, percentile=99)
            for key, model in models.items():
                run = perf.run(model, server.grpc_url, [16], settings)
                # no p99 when perf_analyzer finds no 3 windows alike even at 1000 %: stalls
                figures[key]["p99_c16_60s_ms"] = [run.points[0].p99_ms if run.points
                                                  else float("nan")]
                if not run.points:
                    print(f"perf_analyzer on {model}: {run.error}", flush=True)
            for key, model in models.items():
                figures[key].update(stalls(server, model, p99_seconds))
    return figures


def stalls(server, model: str, seconds: float, over: float = 0.3) -> dict[str, list[float]]:
    """``model`` driven by 16 closed-loop gRPC clients for ``seconds``: every latency kept, so a
    500 ms stall of the batcher shows even where it is too rare for a p99 (its requests, their
    p99.9 and the slowest)."""
    import threading

    from tritonlocal.load import closed_loop

    stop, answers = threading.Event(), []
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    asyncio.run(closed_loop(server.grpc_url, model, 16, nets.synthetic_images(1, seed=5).numpy(),
                            stop, answers=answers))
    latencies = np.array([a.finished - a.started for a in answers])
    return {"requests_60s": [len(latencies)],
            f"over_{int(over * 1000)}ms": [int((latencies > over).sum())],
            "p999_ms": [float(np.percentile(latencies, 99.9) * 1e3)],
            "max_ms": [float(latencies.max() * 1e3)]}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m bench.overhead",
                                     description="issue 47's side-by-side: `pipeline` against "
                                     "the plainest per-batch BLS on its config")
    parser.add_argument("--size", default=SIZE, help="fast (GPU stand-in) or committed (CNNs)")
    parser.add_argument("--queue-policy", action="store_true",
                        help="every config with the queue policy it had until issue 47")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--p99-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True, help="a JSON file")
    args = parser.parse_args(argv)
    figures = side_by_side_run(ROOT / "model_repository", args.size, args.queue_policy,
                               args.rounds, args.p99_seconds)
    med = statistics.median
    table = {
        "throughput c=16 (pipeline / anchor)": med(anchors.paired(figures, "bls", "minimal",
                                                                  "rps_c16")),
        "p50 c=1 (pipeline - anchor, ms)": med(anchors.paired(figures, "bls", "minimal",
                                                              "p50_c1_us", True)) / 1000,
        "stub CPU (pipeline / anchor)": med(anchors.paired(figures, "bls", "minimal",
                                                           "stub_cpu_ms")),
        "p99 c=16 60 s (pipeline, anchor, ms)": (figures["bls"]["p99_c16_60s_ms"][0],
                                                 figures["minimal"]["p99_c16_60s_ms"][0]),
        **{f"{figure} c=16 60 s, closed loop (pipeline, anchor)": (
            figures["bls"][figure][0], figures["minimal"][figure][0])
           for figure in ("requests_60s", "over_300ms", "p999_ms", "max_ms")},
    }
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "table": table, "rounds": figures}, indent=1))
    for figure, value in table.items():
        print(f"{figure}: {value}")
    return 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
