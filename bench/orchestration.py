"""`make bench-orchestration`: the cost of orchestration with the committed CNNs — the same work
five ways (in-process ONNX Runtime, the client calling the sub-models, the anchor, the BLS
`pipeline`, the ensemble) — issue 27's targets against the anchor, and the CPU each way costs per
request in every process."""

from __future__ import annotations

import asyncio

import numpy as np

from bench import anchors, perf, profile
from bench.common import Context, Result, best_point, point_at, ratio_text, target_line
from bls_models import spec as S
from modelgen import nets

ACCOUNTING_CONCURRENCY = 16  # both cores busy for every way of serving the pipeline
SERVER_ROW = "tritonserver, with the ONNX models (C++ onnxruntime backend)"


# Issue 27's targets with the committed CNNs, each a ratio to the anchor measured in the same run.
ANCHOR_TARGETS = {"throughput_c16": 0.97, "p50_c1_over_ms": 0.3}
ANCHOR_ROUNDS = 9


def orchestration(ctx: Context) -> Result:
    result = Result("orchestration", "Cost of orchestration: the same work five ways")
    levels = [1, 4] if ctx.quick else [1, 2, 4, 8, 16, 32, 64]
    url = ctx.server.grpc_url
    local = anchors.InProcess(ctx.repository)
    image = nets.synthetic_images(1, seed=5).numpy()
    seconds = 1.0 if ctx.quick else 6.0
    inproc = [local.measure(lambda: local.pipeline(image), c, seconds) for c in levels]
    for p in inproc:
        result.add("in-process onnxruntime", p, protocol="none")
    direct = [asyncio.run(anchors.client_pipeline(url, c, 20 if ctx.quick else max(300, 30 * c)))
              for c in levels]
    for p in direct:
        result.add("client calls sub-models", p)
    # Side by side, level by level, so that a slow spell of this shared host hits each alike.
    served = {"minimal": ("minimal per-batch BLS (anchor)", "pipeline_minimal"),
              "bls": ("BLS `pipeline`", "pipeline"), "ensemble": ("ensemble", "pipeline_ensemble")}
    runs = perf.interleaved({key: model for key, (_, model) in served.items()}, url, levels,
                            ctx.settings)
    points = {key: result.add_run(served[key][0], run) for key, run in runs.items()}
    ways = {"in-process": inproc, "direct": direct, **points}
    best = {name: best_point(found) for name, found in ways.items()}
    one = {name: point_at(found, 1) for name, found in ways.items()}
    c16 = {name: point_at(found, 16) for name, found in ways.items()}
    labels = {"in-process": "in-process onnxruntime", "direct": "client calls sub-models",
              **{key: label for key, (label, _) in served.items()}}
    result.summary += [
        "| way | best throughput (req/s) | at concurrency | throughput at 16 | p50 at 1 (ms) |",
        "|---|---|---|---|---|",
        *[f"| {labels[k]} | {best[k].throughput:.0f} | {best[k].concurrency} | "
          f"{c16[k].throughput:.0f} | {one[k].p50_ms:.2f} |" for k in ways
          if best[k] and one[k] and c16[k]],
        "", "Standing targets (the sweep above):", "",
        target_line("`pipeline` / ensemble, best throughput",
                best["bls"].throughput / best["ensemble"].throughput
                if best["bls"] and best["ensemble"] else None, 1.0, "higher"),
        target_line("`pipeline` / in-process, best throughput",
                best["bls"].throughput / best["in-process"].throughput
                if best["bls"] and best["in-process"] else None, 0.8, "higher"),
        target_line("`pipeline` / ensemble, p95 at concurrency 16",
                c16["bls"].p95_ms / c16["ensemble"].p95_ms if c16["bls"] and c16["ensemble"]
                else None, 1.2, "lower"),
    ]
    result.data.update({
        "throughput_c16": {k: p.throughput for k, p in c16.items() if p},
        "p50_c1_ms": {k: p.p50_ms for k, p in one.items() if p},
        "best": {k: p.throughput for k, p in best.items() if p}})
    result.summary += anchor_targets(ctx, result)
    # Token 0 is valid (random INT64 would not be); TOKENS is [-1]: 512-token documents.
    zero = ["--input-data", "zero", "--shape", f"TOKENS:{S.TAGGER_SEQ_LEN}"]
    result.add_run("tag_pipeline", perf.run("tag_pipeline", url, levels, ctx.settings, extra=zero))
    result.summary += cpu_accounting(ctx, result, local, image)
    result.plot = {"kind": "curve", "title": "Throughput vs p95 latency (concurrency sweep)",
                   "filter": {"scenario": None}}
    return result


def anchor_targets(ctx: Context, result: Result) -> list[str]:
    """Issue 27's targets with the committed CNNs: `pipeline` against the anchor in interleaved
    rounds (``anchors.side_by_side``)."""
    rounds = 1 if ctx.quick else ANCHOR_ROUNDS
    level = 4 if ctx.quick else 16
    figures = anchors.side_by_side(ctx.server, {"bls": "pipeline", "minimal": "pipeline_minimal"},
                                   rounds, levels=(level,), seconds=1.0 if ctx.quick else 10.0,
                                   quick=ctx.quick)
    ratio = anchors.paired(figures, "bls", "minimal", f"rps_c{level}")
    over = [d / 1000 for d in anchors.paired(figures, "bls", "minimal", "p50_c1_us", True)]
    stub = anchors.paired(figures, "bls", "minimal", "stub_cpu_ms")

    def median(values):
        return float(np.median(values)) if values else None

    anchors.add_rounds(result, figures)
    result.data.update({"throughput_ratio_c16": median(ratio),
                        "p50_over_anchor_ms": median(over), "stub_cpu_ratio": median(stub)})
    return [
        "", f"Targets (issue 27) with the committed CNNs: `pipeline` against the anchor in "
        f"{rounds} interleaved round(s) (order reversed every other round), per round: p50 at "
        f"concurrency 1 (perf_analyzer), then 10 s at concurrency {level}; median of the rounds' "
        "ratios (range):", "",
        "| figure | `pipeline` | minimal per-batch | ratio or difference |", "|---|---|---|---|",
        f"| p50 at concurrency 1 (µs) | {anchors.summary(figures['bls']['p50_c1_us'], 0)} | "
        f"{anchors.summary(figures['minimal']['p50_c1_us'], 0)} | {anchors.summary(over)} ms |",
        f"| req/s at concurrency {level} | {anchors.summary(figures['bls'][f'rps_c{level}'], 1)} "
        f"| {anchors.summary(figures['minimal'][f'rps_c{level}'], 1)} | "
        f"{anchors.summary(ratio)} |",
        f"| stub CPU ms per request | {anchors.summary(figures['bls']['stub_cpu_ms'], 3)} | "
        f"{anchors.summary(figures['minimal']['stub_cpu_ms'], 3)} | {anchors.summary(stub)} |",
        "",
        target_line(f"`pipeline` / minimal per-batch, throughput at concurrency {level}",
                median(ratio), ANCHOR_TARGETS["throughput_c16"], "higher"),
        target_line("`pipeline` − minimal per-batch, p50 at concurrency 1 (ms)", median(over),
                ANCHOR_TARGETS["p50_c1_over_ms"], "lower"),
    ]


def cpu_accounting(ctx: Context, result: Result, local: anchors.InProcess,
                   image: np.ndarray) -> list[str]:
    """Why the throughput ratios are what they are: with both cores busy, throughput is the
    cores divided by the CPU one request costs, summed over every process it touches."""
    concurrency = 4 if ctx.quick else ACCOUNTING_CONCURRENCY
    seconds = 1.0 if ctx.quick else 15.0
    ways = {"minimal": "pipeline_minimal", "bls": "pipeline", "ensemble": "pipeline_ensemble"}
    loads = {way: profile.drive(ctx.server, model, concurrency, seconds,
                                **anchors.QUICK_DRIVE if ctx.quick else {"warmup": 5})
             for way, model in ways.items()}
    measured, inproc_ms = local.cpu_per_request(lambda: local.pipeline(image), 4, seconds)
    columns = {"in-process": {"in-process (one Python process)": inproc_ms},
               **{way: load.cpu_ms_per_request() for way, load in loads.items()}}
    throughput = {"in-process": measured.throughput,
                  **{way: load.requests / load.seconds for way, load in loads.items()}}
    totals = {k: sum(v.values()) for k, v in columns.items()}
    for way, values in columns.items():
        for process, ms in values.items():
            result.rows.append({"experiment": result.name, "variant": f"cpu: {way}",
                                "scenario": "cpu accounting",
                                "process": process, "cpu_ms_per_request": round(ms, 3),
                                "throughput": round(throughput[way], 2)})
    labels = sorted({k for v in columns.values() for k in v},
                    key=lambda k: -max(v.get(k, 0.0) for v in columns.values()))
    order = ("in-process", "minimal", "bls", "ensemble")
    lines = ["", f"CPU per request by process, each way driven at concurrency {concurrency} for "
             f"{seconds:.0f} s (in-process: 4 threads), from /proc of every process (perf_analyzer "
             "included; ms of CPU per completed request). The ONNX models have no process of "
             "their own: Triton's C++ onnxruntime backend runs them inside tritonserver, whose "
             "row includes them:", "",
             "| process | in-process | minimal per-batch BLS | BLS `pipeline` | "
             "`pipeline_ensemble` |",
             "|---|---|---|---|---|"]
    # Stubs of the other loaded models (idle here) in one row.
    driven = {f"{model} stubs" for model in ways.values()}
    idle = {k: sum(v for label, v in columns[k].items() if label.endswith(" stubs")
                   and label not in driven) for k in order}
    for label in labels:
        if label.endswith(" stubs") and label not in driven:
            continue
        cells = [columns[k].get(label, 0.0) for k in order]
        if max(cells) >= 0.05:
            name = SERVER_ROW if label == "tritonserver" else label
            lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" if c else "–" for c in cells) + " |")
    if max(idle.values()) >= 0.05:
        lines.append("| stubs of the other loaded models (idle) | "
                     + " | ".join(f"{idle[k]:.2f}" if idle[k] else "–" for k in order) + " |")
    lines.append("| **total** | " + " | ".join(f"**{totals[k]:.2f}**" for k in order) + " |")
    lines.append("| throughput in this period (req/s) | " + " | ".join(
        f"{throughput[k]:.0f}" for k in order) + " |")
    stubs = {way: sum(v for k, v in columns[way].items() if k.startswith(f"{model} "))
             for way, model in ways.items()}
    lines.append("")
    lines.append(f"- Orchestrator stubs' CPU per request, `pipeline` / minimal per-batch: "
                 f"{stubs['bls']:.2f} / {stubs['minimal']:.2f} ms = "
                 f"{ratio_text(stubs['bls'], stubs['minimal'])}.")
    ens = columns["ensemble"]
    lines += [""]
    for way, label in (("bls", "BLS `pipeline`"), ("minimal", "minimal per-batch BLS")):
        server = columns[way].get("tritonserver", 0.0) - ens.get("tritonserver", 0.0)
        lines.append(
            f"- {label}: with both cores busy, throughput ≈ cores / CPU per request, so "
            f"against the ensemble ≈ {totals['ensemble']:.1f} / {totals[way]:.1f} = "
            f"**{totals['ensemble'] / totals[way]:.2f}** (measured in this period: "
            f"{ratio_text(throughput[way], throughput['ensemble'])}), against in-process ≈ "
            f"{totals['in-process']:.1f} / {totals[way]:.1f} = "
            f"**{totals['in-process'] / totals[way]:.2f}** (measured: "
            f"{ratio_text(throughput[way], throughput['in-process'])}). Its stubs cost "
            f"{stubs[way]:.2f} ms per request and tritonserver {server:+.2f} ms against the "
            "ensemble.")
    lines.append("- What BLS pays and the ensemble does not: each client request and each "
                 "sub-request crosses the python backend's shared-memory IPC (stub and server "
                 "side); a batch's requests share its sub-requests, not their own crossing.")
    return lines
