"""The benchmark experiments. Each takes a ``Context`` (a running server and settings) and returns
a ``Result``: rows for the CSV, a summary (ratios against the targets) and the command lines.

Everything one experiment compares is measured in the same run, side by side, because the
machine is shared and noisy: ratios are meaningful, absolute numbers much less so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import anchors, clients, control_flow, designs, overhead, perf, profile
from bench.perf import Point
from bls_models import pipelines
from bls_models import spec as S
from modelgen import export, nets, variants
from tritonlocal import flags, load

SHM_OUTPUT_BYTES = 4 * 512 * 14041 + 1024  # one tagger output (28.7 MB) for perf_analyzer's shm
LONG_DEADLINE_PIPELINE = "pipeline_deadline_120s"
LOGITS_TAG_PIPELINE = "tag_pipeline_logits"  # tag_pipeline over `tagger`: reduced in the stub
# `pipeline` admitting what this machine answers within about a second (~70 req/s): 2 x 8 in
# flight (plus a batch of 16 being handed over), no queue in the orchestrator and a queue of 16
# in Triton, 64 in all, against the committed 2 x (512 in flight + 512 queued) and a queue of
# 4 096.
SHEDDING_PIPELINE = "pipeline_shed"
ACCOUNTING_CONCURRENCY = 16  # both cores busy for every way of serving the pipeline
SERVER_ROW = "tritonserver, with the ONNX models (C++ onnxruntime backend)"


@dataclass
class Context:
    server: object            # tritonlocal.TritonServer, serving the repository + variants
    repository: Path
    settings: perf.Settings

    @property
    def quick(self) -> bool:
        return self.settings.quick


@dataclass
class Result:
    name: str
    title: str
    rows: list[dict] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)   # markdown lines
    commands: list[str] = field(default_factory=list)
    plot: dict | None = None                            # {"kind": ..., "series": ...}
    data: dict = field(default_factory=dict)            # machine-readable outcome (JSON)

    def add(self, variant: str, point: Point, protocol: str = "grpc", errors: int = 0, **extra):
        self.rows.append({"experiment": self.name, "variant": variant, "protocol": protocol,
                          **dataclasses.asdict(point), "errors": errors, **extra})

    def add_run(self, variant: str, run: perf.Run, protocol: str = "grpc", **extra) -> list[Point]:
        self.commands.append(run.command_line)
        if run.error:
            self.summary.append(f"- **{variant}: perf_analyzer failed**: {run.error}")
        for concurrency, reason in run.retried:
            self.summary.append(f"- {variant}: the first perf_analyzer attempt at concurrency "
                                f"{concurrency} did not complete ({reason}); the retry did")
        for p in run.points:
            self.add(variant, p, protocol, **extra)
        return run.points


# -- variants the experiments need beside the committed repository ---------------------------------
def variant_specs(repository: Path) -> list[tuple[S.ModelSpec, str]]:
    """(spec, base) pairs: base is the committed model whose code or ONNX file the variant uses."""
    # perf_analyzer cannot give a request a timeout, so at 1 000 in flight it gets the default
    # deadline (10 s); this variant gives it the budget the project's clients set per request.
    budget = dataclasses.replace(S.PIPELINE, name=LONG_DEADLINE_PIPELINE,
                                 parameters={**S.PIPELINE.parameters,
                                             "default_deadline_ms": str(clients.BUDGET_US // 1000),
                                             "stage_model_repositories": str(repository)})
    taggers = [dataclasses.replace(S.TAGGER, name=f"tagger_delay_{label}",
                                   batching=dataclasses.replace(S.TAGGER.batching,
                                                                max_queue_delay_us=delay))
               for label, delay in (("100ms", 100_000), ("100us", 100))]
    logits = dataclasses.replace(S.TAG_PIPELINE, name=LOGITS_TAG_PIPELINE,
                                 parameters={**S.TAG_PIPELINE.parameters, "tagger_model": "tagger",
                                             "stage_model_repositories": str(repository)})
    shedding = dataclasses.replace(
        S.PIPELINE, name=SHEDDING_PIPELINE,
        parameters={**S.PIPELINE.parameters, "max_inflight_requests": "8",
                    "max_queued_requests": "0", "stage_model_repositories": str(repository)},
        batching=dataclasses.replace(S.PIPELINE.batching, max_queue_size=16))
    return ([(budget, "pipeline"), (logits, "tag_pipeline"), (shedding, "pipeline")]
            + [(t, "tagger") for t in taggers]
            + [(c, S.DIGITS_CASCADE.name) for c in control_flow.cascade_variants(repository)])


def build_variants(target: Path, repository: Path) -> Path:
    """Fault models (the designs use them) and the benchmark variants, in ``target``."""
    variants.build(target, repository, variants=())
    return write_variants(target, repository)


def build_test_repository(target: Path, repository: Path) -> Path:
    """What the test suite serves beside ``repository``, in ``target`` (a fresh directory): the
    fault models, the test variants and the benchmark variants (tests/conftest.py,
    scripts/container-test.sh)."""
    variants.build(target, repository)
    return write_variants(target, repository)


def write_variants(target: Path, repository: Path) -> Path:
    for spec, base in variant_specs(repository):
        if spec.backend == "onnxruntime":
            variants.write_onnx(target, spec, export.onnx_path(repository, S.model(base)))
        else:
            variants.write(target, spec)
    # The runtime's measuring sticks (bench/anchors.py): the anchor, the sequential fan-out and
    # the concurrency designs.
    anchors.write(target, anchors.like_pipeline("pipeline_minimal",
                                                stage_model_repositories=str(repository)),
                  anchors.MINIMAL)
    anchors.write(target, dataclasses.replace(
        anchors.SEQUENTIAL.model_spec(), parameters={
            **anchors.SEQUENTIAL.model_spec().parameters,
            "stage_model_repositories": str(repository)}), anchors.SEQUENTIAL_MODEL_PY)
    designs.write_designs(target, repository)
    return target


def _best(points: list[Point]) -> Point | None:
    return max(points, key=lambda p: p.throughput) if points else None


def _at(points: list[Point], concurrency: int) -> Point | None:
    return next((p for p in points if p.concurrency == concurrency), None)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def _target(label: str, value: float | None, limit: float, better: str) -> str:
    if value is None:
        return f"- {label}: not measured"
    met = value >= limit if better == "higher" else value <= limit
    return (f"- {label}: **{value:.2f}** (target {'≥' if better == 'higher' else '≤'} {limit}) — "
            + ("met" if met else f"**missed** by {abs(value - limit):.2f}"))


# -- 1. cost of orchestration ---------------------------------------------------------------------
# Issue 27's targets with the committed CNNs, each a ratio to the anchor measured in the same run.
ANCHOR_TARGETS = {"throughput_c16": 0.97, "p50_c1_over_ms": 0.3}
ANCHOR_ROUNDS = 5


def orchestration(ctx: Context) -> Result:
    result = Result("orchestration", "Cost of orchestration: the same work five ways")
    levels = [1, 4] if ctx.quick else [1, 2, 4, 8, 16, 32, 64]
    url = ctx.server.grpc_url
    local = clients.InProcess(ctx.repository)
    image = nets.synthetic_images(1, seed=5).numpy()
    seconds = 1.0 if ctx.quick else 6.0
    inproc = [local.measure(lambda: local.pipeline(image), c, seconds) for c in levels]
    for p in inproc:
        result.add("in-process onnxruntime", p, protocol="none")
    direct = [asyncio.run(clients.client_pipeline(url, c, 20 if ctx.quick else max(300, 30 * c)))
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
    best = {name: _best(found) for name, found in ways.items()}
    one = {name: _at(found, 1) for name, found in ways.items()}
    c16 = {name: _at(found, 16) for name, found in ways.items()}
    labels = {"in-process": "in-process onnxruntime", "direct": "client calls sub-models",
              **{key: label for key, (label, _) in served.items()}}
    result.summary += [
        "| way | best throughput (req/s) | at concurrency | throughput at 16 | p50 at 1 (ms) |",
        "|---|---|---|---|---|",
        *[f"| {labels[k]} | {best[k].throughput:.0f} | {best[k].concurrency} | "
          f"{c16[k].throughput:.0f} | {one[k].p50_ms:.2f} |" for k in ways
          if best[k] and one[k] and c16[k]],
        "", "Standing targets (the sweep above):", "",
        _target("`pipeline` / ensemble, best throughput",
                best["bls"].throughput / best["ensemble"].throughput
                if best["bls"] and best["ensemble"] else None, 1.0, "higher"),
        _target("`pipeline` / in-process, best throughput",
                best["bls"].throughput / best["in-process"].throughput
                if best["bls"] and best["in-process"] else None, 0.8, "higher"),
        _target("`pipeline` / ensemble, p95 at concurrency 16",
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
                                   rounds, levels=(level,), seconds=2.0 if ctx.quick else 10.0)
    ratio = anchors.paired(figures, "bls", "minimal", f"rps_c{level}")
    over = [d / 1000 for d in anchors.paired(figures, "bls", "minimal", "p50_c1_us", True)]
    stub = anchors.paired(figures, "bls", "minimal", "stub_cpu_ms")
    median = lambda values: float(np.median(values)) if values else None  # noqa: E731
    for key, values in figures.items():
        for figure, per_round in values.items():
            for index, value in enumerate(per_round):
                result.rows.append({"experiment": result.name, "variant": f"anchor: {key}",
                                    "scenario": "targets", "figure": figure,
                                    "round": index + 1, "value": round(value, 3)})
    result.data.update({"anchor_rounds": figures, "throughput_ratio_c16": median(ratio),
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
        _target(f"`pipeline` / minimal per-batch, throughput at concurrency {level}",
                median(ratio), ANCHOR_TARGETS["throughput_c16"], "higher"),
        _target("`pipeline` − minimal per-batch, p50 at concurrency 1 (ms)", median(over),
                ANCHOR_TARGETS["p50_c1_over_ms"], "lower"),
    ]


def cpu_accounting(ctx: Context, result: Result, local: clients.InProcess,
                   image: np.ndarray) -> list[str]:
    """Why the throughput ratios are what they are: with both cores busy, throughput is the
    cores divided by the CPU one request costs, summed over every process it touches."""
    concurrency = 4 if ctx.quick else ACCOUNTING_CONCURRENCY
    seconds = 2.0 if ctx.quick else 15.0
    ways = {"minimal": "pipeline_minimal", "bls": "pipeline", "ensemble": "pipeline_ensemble"}
    loads = {way: profile.drive(ctx.server, model, concurrency, seconds,
                                warmup=1 if ctx.quick else 5) for way, model in ways.items()}
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
                 f"{_ratio(stubs['bls'], stubs['minimal'])}.")
    ens = columns["ensemble"]
    lines += [""]
    for way, label in (("bls", "BLS `pipeline`"), ("minimal", "minimal per-batch BLS")):
        server = columns[way].get("tritonserver", 0.0) - ens.get("tritonserver", 0.0)
        lines.append(
            f"- {label}: with both cores busy, throughput ≈ cores / CPU per request, so "
            f"against the ensemble ≈ {totals['ensemble']:.1f} / {totals[way]:.1f} = "
            f"**{totals['ensemble'] / totals[way]:.2f}** (measured in this period: "
            f"{_ratio(throughput[way], throughput['ensemble'])}), against in-process ≈ "
            f"{totals['in-process']:.1f} / {totals[way]:.1f} = "
            f"**{totals['in-process'] / totals[way]:.2f}** (measured: "
            f"{_ratio(throughput[way], throughput['in-process'])}). Its stubs cost "
            f"{stubs[way]:.2f} ms per request and tritonserver {server:+.2f} ms against the "
            "ensemble.")
    lines.append("- What BLS pays and the ensemble does not: each client request and each "
                 "sub-request crosses the python backend's shared-memory IPC (stub and server "
                 "side); a batch's requests share its sub-requests, not their own crossing.")
    return lines


# -- 2. async fan-out vs sequential -----------------------------------------------------------------
def fanout(ctx: Context) -> Result:
    result = Result("fanout", "Async fan-out vs sequential branches (concurrency 1)")
    url = ctx.server.grpc_url
    # perf_analyzer, once each: the issue's tool, and a cross-check.
    checked = {}
    for label, model in (("perf_analyzer: concurrent fan-out (`pipeline`)", "pipeline"),
                         ("perf_analyzer: sequential (`pipeline_sequential`)", "pipeline_sequential")):
        checked[model] = (result.add_run(label, perf.run(model, url, [1], ctx.settings)) or [None])[0]
    # The ratio itself: both pipelines and each stage alone, one request at a time, in
    # interleaved rounds so that a slow spell of this shared machine hits every one alike (two
    # full runs measured 0.68 and 0.84 one after the other with each measured once). The few-ms
    # stages also gave perf_analyzer no stable measurement at concurrency 1 here.
    image = nets.synthetic_images(1, seed=5).numpy()
    pixels = np.zeros((1, 3, S.IMAGE_SIZE, S.IMAGE_SIZE), np.float32)
    count, rounds = (20, 1) if ctx.quick else (200, 3)
    subjects = (("concurrent fan-out (`pipeline`)", "pipeline", {"IMAGE": image}),
                ("sequential (`pipeline_sequential`)", "pipeline_sequential", {"IMAGE": image}),
                ("`preprocess` alone", "preprocess", {"IMAGE": image}),
                ("`classifier` alone", "classifier", {"PIXELS": pixels}),
                ("`embedder` alone", "embedder", {"PIXELS": pixels}))
    p50: dict[str, list[float]] = {model: [] for _, model, _ in subjects}
    for round_ in range(rounds):
        for label, model, inputs in subjects:
            point = clients.sequential_latency(url, model, inputs, count)
            p50[model].append(point.p50_ms)
            result.add(label, point, requests=count, round=round_ + 1)
    median = {model: float(np.median(values)) for model, values in p50.items()}
    ratios = [c / s for c, s in zip(p50["pipeline"], p50["pipeline_sequential"])]
    ratio = float(np.median(ratios))
    result.summary.append(
        f"Project client, {rounds} interleaved round(s) of {count} sequential requests per model; "
        "medians of the rounds' p50s (ms): " + ", ".join(
            f"{label} {median[model]:.2f}" for label, model, _ in subjects) + ".")
    result.summary.append("")
    result.summary.append(_target("p50 concurrent / sequential (median of the rounds' ratios: "
                                  + ", ".join(f"{r:.2f}" for r in ratios) + ")", ratio, 0.6, "lower"))
    pre, a, b = (median[m] for m in ("preprocess", "classifier", "embedder"))
    ideal = (pre + max(a, b)) / (pre + a + b)
    result.data.update(ratio=round(ratio, 3), ideal_ratio=round(ideal, 3))
    result.summary.append(
        f"- The best any fan-out can do with these stages (each over its own client hop): "
        f"(pre + max(a, b)) / (pre + a + b) = **{ideal:.2f}**; without preprocess, "
        f"max(a, b) / (a + b) = {max(a, b) / (a + b):.2f}. A ratio of 0.6 needs branches closer "
        f"in cost than these two; achieved / ideal = **{ratio / ideal:.2f}**.")
    if checked["pipeline"] and checked["pipeline_sequential"]:
        result.summary.append(
            f"- perf_analyzer, once each: {checked['pipeline'].p50_ms:.2f} / "
            f"{checked['pipeline_sequential'].p50_ms:.2f} ms = "
            f"{checked['pipeline'].p50_ms / checked['pipeline_sequential'].p50_ms:.2f}.")
    result.plot = {"kind": "bars", "title": "p50 latency at concurrency 1 (ms)"}
    return result


# -- 3. orchestrator concurrency designs ----------------------------------------------------------
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
    for _ in range(2):
        for design in designs.DESIGNS:
            designs.head_of_line(url, dataclasses.replace(design, instances=0), image)
    hol_rounds: dict[str, list[tuple[list[float], int]]] = {d.name: [] for d in designs.DESIGNS}
    for _ in range(rounds):
        for design in designs.DESIGNS:
            hol_rounds[design.name].append(designs.head_of_line(url, design, image))
    for design in designs.DESIGNS:
        measured = hol_rounds[design.name]
        fast = [latency for latencies, _ in measured for latency in latencies]
        missing = sum(lost for _, lost in measured)
        result.add(design.name, clients.point(50, fast, 1.0), errors=missing,
                   scenario="head-of-line")
        p50 = float(np.median([np.percentile(l, 50) * 1e3 if l else np.nan for l, _ in measured]))
        worst = float(np.median([max(l, default=0) * 1e3 for l, _ in measured]))
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


# -- 4. the large-output case ---------------------------------------------------------------------
def large_output(ctx: Context) -> Result:
    result = Result("large_output", "The large-output case (tagger, 28.7 MB per sequence), concurrency 1")
    url_grpc, url_http = ctx.server.grpc_url, ctx.server.http_url
    # Token 0 is valid (random INT64 would not be); TOKENS is [-1]: 512-token documents.
    zero = ["--input-data", "zero", "--shape", f"TOKENS:{S.TAGGER_SEQ_LEN}"]
    # Registering regions is an admin API: the credential goes along, over HTTP, as perf_analyzer
    # 2.51 sends no headers over gRPC (reports print it redacted: perf.Run.command_line).
    credential = flags.header_line(next(iter(ctx.server.admin_headers.items())))
    shm = ["--shared-memory", "system", "--output-shared-memory-size", str(SHM_OUTPUT_BYTES),
           "-H", credential]
    cases = [
        ("`tagger` over HTTP", "tagger", url_http, "http", zero),
        ("`tagger` over gRPC", "tagger", url_grpc, "grpc", zero),
        ("`tagger` over HTTP + system shared memory", "tagger", url_http, "http", zero + shm),
        ("`tagger_tags` (the reduction in the ONNX graph), gRPC", "tagger_tags", url_grpc, "grpc",
         zero),
        ("`tag_pipeline` over `tagger_tags` (committed), gRPC", "tag_pipeline", url_grpc, "grpc",
         zero),
        ("`tag_pipeline` over `tagger` (logits reduced in the orchestrator), gRPC",
         LOGITS_TAG_PIPELINE, url_grpc, "grpc", zero),
        ("`tagger`, max_queue_delay 100 000 µs, gRPC", "tagger_delay_100ms", url_grpc, "grpc", zero),
        ("`tagger`, max_queue_delay 100 µs, gRPC", "tagger_delay_100us", url_grpc, "grpc", zero),
    ]
    p50 = {}
    for label, model, url, protocol, extra in cases:
        points = result.add_run(label, perf.run(model, url, [1], ctx.settings, protocol=protocol,
                                                extra=extra), protocol=protocol)
        p50[label] = points[0].p50_ms if points else None
    local = clients.InProcess(ctx.repository)
    tokens = np.zeros((1, S.TAGGER_SEQ_LEN), dtype=np.int64)
    inproc = local.measure(lambda: local.tagger(tokens), 1, 1.0 if ctx.quick else 6.0)
    result.add("in-process onnxruntime `tagger`", inproc, protocol="none")
    # The same work tag_pipeline does, without serving: the reduction is not free (it reads all
    # 28.7 MB), so this is the fair baseline for what serving it costs.
    reduced = local.measure(lambda: pipelines.reduce_tags(local.tagger(tokens)), 1,
                            1.0 if ctx.quick else 6.0)
    result.add("in-process `tagger` + the same reduction", reduced, protocol="none")
    in_graph = local.measure(lambda: local.tagger_tags(tokens), 1, 1.0 if ctx.quick else 6.0)
    result.add("in-process `tagger_tags` (reduction in the graph)", in_graph, protocol="none")
    result.summary += ["| case | p50 (ms) | × in-process |", "|---|---|---|"]
    for label in [c[0] for c in cases]:
        if p50[label]:
            result.summary.append(f"| {label} | {p50[label]:.1f} | {p50[label] / inproc.p50_ms:.2f} |")
    result.summary.append(f"| in-process onnxruntime `tagger` | {inproc.p50_ms:.1f} | 1.00 |")
    result.summary.append(f"| in-process `tagger` + the same reduction (numpy) | "
                          f"{reduced.p50_ms:.1f} | {reduced.p50_ms / inproc.p50_ms:.2f} |")
    result.summary.append(f"| in-process `tagger_tags` (the reduction in the ONNX graph) | "
                          f"{in_graph.p50_ms:.1f} | {in_graph.p50_ms / inproc.p50_ms:.2f} |")
    tag = p50.get("`tag_pipeline` over `tagger_tags` (committed), gRPC")
    tag_logits = p50.get("`tag_pipeline` over `tagger` (logits reduced in the orchestrator), gRPC")
    result.summary.append("")
    result.summary.append(_target("`tag_pipeline` p50 / in-process `tagger` p50",
                                  tag / inproc.p50_ms if tag else None, 1.25, "lower"))
    if tag:
        result.summary.append(
            f"- What serving adds to the same work: `tag_pipeline` / in-process `tagger_tags` = "
            f"**{tag / in_graph.p50_ms:.2f}**; the reduction itself costs "
            f"{in_graph.p50_ms - inproc.p50_ms:.1f} ms in ONNX Runtime "
            f"({in_graph.p50_ms / inproc.p50_ms:.2f}× the logits-only network) and "
            f"{reduced.p50_ms - inproc.p50_ms:.1f} ms in numpy.")
    if tag and tag_logits:
        result.summary.append(
            f"- Reducing in the graph instead of in the orchestrator: p50 {tag_logits:.1f} → "
            f"{tag:.1f} ms (× {tag / tag_logits:.2f}): the 28.7 MB per sequence is no longer "
            "copied out of tritonserver (where the onnxruntime backend computes it) into the "
            "orchestrator's shared-memory region.")
    result.plot = {"kind": "bars", "title": "p50 latency at concurrency 1 (ms)"}
    return result


# -- 5. sync vs async clients at high concurrency --------------------------------------------------
def client_styles(ctx: Context) -> Result:
    result = Result("clients", "Synchronous vs asyncio clients at high concurrency (`pipeline`, gRPC)")
    levels = [10] if ctx.quick else [100, 500, 1000]
    url = ctx.server.grpc_url
    result.summary += ["| client | concurrency | requests | throughput (req/s) | p50 / p95 / p99 (ms) "
                       "| errors | unanswered |", "|---|---|---|---|---|---|---|"]
    for c in levels:
        count = 2 * c
        for label, measured in (
            ("threads, blocking client", clients.sync_clients(url, "pipeline", c, count)),
            ("asyncio client", asyncio.run(clients.async_client(url, "pipeline", c, count))),
        ):
            p, errors, unanswered = measured
            result.add(label, p, errors=errors, unanswered=unanswered, requests=count)
            result.summary.append(f"| {label} | {c} | {count} | {p.throughput:.0f} | {p.p50_ms:.0f} / "
                                  f"{p.p95_ms:.0f} / {p.p99_ms:.0f} | {errors} | {unanswered} |")
        # Windows of a fixed request count (2 x concurrency): with 1 000 in flight and
        # latencies of seconds, 3 s time windows hold too few completions to settle.
        windows = [] if ctx.quick else ["--measurement-mode", "count_windows",
                                        "--measurement-request-count", str(2 * c),
                                        "--stability-percentage", "50", "--max-trials", "5"]
        run = perf.run(LONG_DEADLINE_PIPELINE, url, [c], ctx.settings,
                       extra=["--async", *windows])
        for p in result.add_run("perf_analyzer --async", run):
            window = "(time windows)" if ctx.quick else f"(windows of {2 * c})"
            result.summary.append(f"| perf_analyzer --async | {c} | {window} | {p.throughput:.0f} | "
                                  f"{p.p50_ms:.0f} / {p.p95_ms:.0f} / {p.p99_ms:.0f} | 0 | 0 |")
    result.summary.append("- A perf_analyzer row exists only for an error-free run: perf_analyzer stops at "
                          "the first request error, and the report then says so above.")
    result.summary.append(f"- perf_analyzer cannot set a request timeout, so it drives "
                          f"`{LONG_DEADLINE_PIPELINE}` (`pipeline` with a 120 s default deadline): "
                          "the same 120 s budget the project's clients give every request.")
    result.plot = {"kind": "curve", "title": "Clients: throughput vs p95 latency"}
    return result


# -- 6. tuning ----------------------------------------------------------------------------------
# A coordinate sweep, as Model Analyzer's "quick" search does: instance count first (the largest
# effect on a CPU), then the batching delay at the best count, then preferred batch sizes at the
# best delay; then the orchestrator's instance count over the tuned sub-models. Each stage keeps
# the previous winner, so 3 + 2 + 2 variants per model are measured instead of the 27 of the
# full grid. Every variant is measured at every level of TUNING_LEVELS.
TUNING_INSTANCES = (1, 2, 4)
TUNING_DELAYS_US = (100, 500, 2000)
TUNING_PREFERRED = ((), (4, 8), (8, 16))
TUNING_LEVELS = (2, 4, 8, 16)
ORCHESTRATOR_INSTANCES = (1, 2, 4)
ORCHESTRATOR_LEVELS = (4, 8, 16, 32)
# The latency budget is relative, because absolute latency differs up to 2x between hosts of
# the same kind (measured: the classifier at 3.5 and at 7 ms per image): p95 under load may be at
# most BUDGET_FACTOR times the model's unloaded p50 (committed config, concurrency 1), measured
# in the same run. On a GPU host, replace it with the service's own p95 objective.
BUDGET_FACTOR = 4.0


@dataclass
class Candidate:
    stage: str
    spec: S.ModelSpec
    point: Point


def _knobs(spec: S.ModelSpec) -> dict:
    return {"instance_count": spec.instance_count,
            "max_queue_delay_us": spec.batching.max_queue_delay_us,
            "preferred_batch_sizes": list(spec.batching.preferred_batch_sizes)}


def _describe(spec: S.ModelSpec) -> str:
    k = _knobs(spec)
    preferred = ",".join(map(str, k["preferred_batch_sizes"])) or "none"
    if spec.backend == "python":
        return f"{k['instance_count']} instances"
    return f"{k['instance_count']} inst, delay {k['max_queue_delay_us']} µs, preferred {preferred}"


def _tuned(model: S.ModelSpec, instances: int | None = None, delay: int | None = None,
           preferred: tuple[int, ...] | None = None) -> S.ModelSpec:
    instances = model.instance_count if instances is None else instances
    batching = model.batching
    if delay is not None:
        batching = dataclasses.replace(batching, max_queue_delay_us=delay)
    if preferred is not None:
        batching = dataclasses.replace(batching, preferred_batch_sizes=preferred)
    return dataclasses.replace(model, instance_count=instances, batching=batching)


def _measure_stage(ctx: Context, result: Result, stage: str, base: S.ModelSpec,
                   specs: list[S.ModelSpec], levels: list[int], write, baseline: bool = False
                   ) -> tuple[list[Candidate], float | None]:
    """Serve ``specs`` (renamed ``base__<n>``) on a server of their own and measure each at
    ``levels``; with ``baseline``, also the committed ``base`` at concurrency 1 (the unloaded
    p50 the budget is relative to)."""
    import tempfile

    from tritonlocal import TritonServer, on_free_ports

    named = [dataclasses.replace(spec, name=f"{base.name}__{stage}{n}") for n, spec in enumerate(specs)]
    candidates, unloaded = [], None
    with tempfile.TemporaryDirectory(prefix="tuning-") as tmp:
        repo = Path(tmp) / "repo"
        write(repo, named + ([dataclasses.replace(base, name=f"{base.name}__committed")]
                             if baseline else []))
        with TritonServer(on_free_ports(repo, Path(tmp) / "tritonserver.log")) as server:
            if baseline:
                run = perf.run(f"{base.name}__committed", server.grpc_url, [1], ctx.settings)
                result.add_run(f"{base.name} committed (unloaded)", run, model=base.name,
                               stage="unloaded", **_knobs(base))
                unloaded = run.points[0].p50_ms if run.points else None
            for spec, original in zip(named, specs):
                run = perf.run(spec.name, server.grpc_url, levels, ctx.settings)
                points = result.add_run(f"{base.name}: {_describe(spec)}", run, model=base.name,
                                        stage=stage, **_knobs(spec))
                candidates += [Candidate(stage, original, p) for p in points]
    return candidates, unloaded


def _pick(candidates: list[Candidate], budget: float | None) -> Candidate | None:
    within = [c for c in candidates if budget is not None and c.point.p95_ms <= budget]
    return max(within, key=lambda c: c.point.throughput) if within else None


def _onnx_writer(ctx: Context, model: S.ModelSpec):
    def write(repo: Path, specs: list[S.ModelSpec]) -> None:
        for spec in specs:
            variants.write_onnx(repo, spec, export.onnx_path(ctx.repository, model))
    return write


def tune_sub_model(ctx: Context, result: Result, model: S.ModelSpec, levels: list[int]
                   ) -> tuple[S.ModelSpec, Candidate | None, float | None, list[Candidate]]:
    """Instances, then delay, then preferred sizes: (winner spec, its point, budget, all points)."""
    write = _onnx_writer(ctx, model)
    cands, budget, best = _instances_stage(ctx, result, "i", model, TUNING_INSTANCES, levels,
                                           write)
    seen = list(cands)
    if ctx.quick:
        return (best.spec if best else model), best, budget, seen
    current = best.spec if best else model
    for stage, options, make in (
            ("d", TUNING_DELAYS_US, lambda v: _tuned(current, delay=v)),
            ("p", TUNING_PREFERRED, lambda v: _tuned(current, preferred=v))):
        fresh = [make(v) for v in options if make(v) != current]
        more, _ = _measure_stage(ctx, result, stage, model, fresh, levels, write)
        seen += more
        kept = [c for c in cands if c.spec == current]
        cands = kept + more
        best = _pick(cands, budget) or best
        current = best.spec if best else current
    return current, best, budget, seen


def tune_orchestrator(ctx: Context, result: Result, tuned: dict[str, S.ModelSpec],
                      levels: list[int]
                      ) -> tuple[S.ModelSpec, Candidate | None, float | None, list[Candidate]]:
    """The pipeline's instance count, over the tuned sub-models (served under their own names)."""
    base = S.PIPELINE

    def write(repo: Path, specs: list[S.ModelSpec]) -> None:
        for name, spec in tuned.items():
            variants.write_onnx(repo, spec, export.onnx_path(ctx.repository, S.model(name)))
        for spec in specs:
            spec = dataclasses.replace(spec, parameters={**spec.parameters,
                                                         "stage_model_repositories": str(repo)})
            variants.write(repo, spec)

    cands, budget, best = _instances_stage(ctx, result, "o", base, ORCHESTRATOR_INSTANCES,
                                           levels, write)
    return (best.spec if best else base), best, budget, cands


def _instances_stage(ctx: Context, result: Result, stage: str, model: S.ModelSpec, counts,
                     levels: list[int], write) -> tuple[list[Candidate], float | None,
                                                        Candidate | None]:
    """The first tuning stage (instance counts, with the unloaded baseline that sets the latency
    budget): (candidates, budget, best within it)."""
    counts = [1, 2] if ctx.quick else list(counts)
    cands, unloaded = _measure_stage(ctx, result, stage, model,
                                     [_tuned(model, instances=n) for n in counts],
                                     levels, write, baseline=True)
    budget = unloaded * BUDGET_FACTOR if unloaded else None
    return cands, budget, _pick(cands, budget)


def tuning(ctx: Context) -> Result:
    """Per sub-model of ``pipeline``: the highest throughput whose p95 is within the budget,
    over instance count, batching delay and preferred batch sizes; then the orchestrator."""
    result = Result("tuning", "Tuning: instances, batching delay and preferred batch sizes")
    models = [S.CLASSIFIER] if ctx.quick else [S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER]
    levels = [2] if ctx.quick else list(TUNING_LEVELS)
    result.summary += [
        f"Coordinate sweep per model: instances {list(TUNING_INSTANCES)}, then "
        f"max_queue_delay_microseconds {list(TUNING_DELAYS_US)} at the best count, then "
        f"preferred_batch_size {[list(p) for p in TUNING_PREFERRED]} at the best delay; each "
        f"variant at concurrency {levels}. Then `pipeline`'s instance count "
        f"{list(ORCHESTRATOR_INSTANCES)} over the tuned sub-models, at concurrency "
        f"{list(ORCHESTRATOR_LEVELS)}. Winner: the highest throughput whose p95 is within the "
        f"budget, {BUDGET_FACTOR:g}× the model's unloaded p50 (committed config, concurrency 1, "
        "same run).", ""]
    table = ["| model | committed | winner | throughput (req/s) | p95 (ms) | budget (ms) |"
             " committed's best within budget (req/s) |", "|---|---|---|---|---|---|---|"]
    winners: dict[str, dict] = {}
    tuned: dict[str, S.ModelSpec] = {}

    def row(model: S.ModelSpec, spec: S.ModelSpec, best: Candidate | None, budget, cands):
        committed_best = _pick([c for c in cands if c.spec == _tuned(model)], budget)
        mine = f"{committed_best.point.throughput:.0f}" if committed_best else "none"
        if best is None:
            table.append(f"| {model.name} | {_describe(model)} | none within budget "
                                  f"(kept committed) | | | {budget or 0:.1f} | {mine} |")
            return
        winners[model.name] = _knobs(spec) | {"throughput": round(best.point.throughput, 1),
                                              "p95_ms": best.point.p95_ms,
                                              "concurrency": best.point.concurrency,
                                              "budget_ms": round(budget, 2)}
        table.append(
            f"| {model.name} | {_describe(model)} | **{_describe(spec)}** (at concurrency "
            f"{best.point.concurrency}) | {best.point.throughput:.0f} | {best.point.p95_ms:.1f} "
            f"| {budget:.1f} | {mine} |")

    for model in models:
        spec, best, budget, seen = tune_sub_model(ctx, result, model, levels)
        tuned[model.name] = spec
        row(model, spec, best, budget, seen)
    if not ctx.quick:
        row(S.PIPELINE, *tune_orchestrator(ctx, result, tuned, list(ORCHESTRATOR_LEVELS)))
    result.data = {"winners": winners, "budget_factor": BUDGET_FACTOR}
    result.summary += ["", *table, "", "The committed values in `bls_models/spec.py` are these winners (a unit test, "
        "`tests/unit/test_tuned_values.py`, fails when they drift apart). Differences of a few "
        "percent are within this machine's noise. On a GPU host: `make bench-tuning` runs the "
        "same sweep (instances become per-GPU counts under KIND_AUTO); set the budget to the "
        "service's p95 objective, apply the winners in `bls_models/spec.py`, `make configs`."]
    result.plot = {"kind": "curve", "title": "Tuning: throughput vs p95 per variant",
                   "facet": "model"}
    return result


# -- 7. overload ----------------------------------------------------------------------------------
def _admission(spec: S.ModelSpec) -> int:
    """Requests a model takes before refusing: per instance, those in flight, those waiting for
    a slot and a batch being handed over; times instances, plus its queue in Triton."""
    per_instance = (int(spec.parameters["max_inflight_requests"])
                    + int(spec.parameters["max_queued_requests"]) + spec.max_batch_size)
    return spec.instance_count * per_instance + spec.batching.max_queue_size


def overload(ctx: Context) -> Result:
    result = Result("overload", "Overload: closed-loop clients far above capacity (`pipeline`, gRPC)")
    levels = [8, 64] if ctx.quick else [16, 64, 256, 1024]
    seconds = 3.0 if ctx.quick else 20.0
    backoff = 0.1  # a refused client waits this long before it tries again
    data = nets.synthetic_images(1, seed=7).numpy()
    shedding = next(spec for spec, _ in variant_specs(ctx.repository)
                    if spec.name == SHEDDING_PIPELINE)
    models = {"pipeline": S.PIPELINE, SHEDDING_PIPELINE: shedding}
    result.summary += [
        f"Each client sends its next request as soon as the last is answered ({seconds:.0f} s per "
        f"level, {backoff * 1e3:.0f} ms pause after an error), with no request timeout: the "
        "orchestrator's default "
        f"deadline ({int(S.PIPELINE.parameters['default_deadline_ms']) // 1000} s) applies. "
        "Refused: UNAVAILABLE because a queue was full; late: the orchestrator's deadline error.",
        "", "| model (admits at most) | clients | answered/s | answered p50 / p99 (ms) | refused "
        "| refused p50 / p99 (ms) | late | other errors |", "|---|---|---|---|---|---|---|---|"]
    for name, spec in models.items():
        for clients_count in levels:
            answers = load.closed_loop_for(ctx.server.grpc_url, name, clients_count, data,
                                              seconds, retry_pause=backoff)
            wall = max(a.finished for a in answers) - min(a.started for a in answers)
            ok = [a.seconds for a in answers if a.code is None]
            refused = [a.seconds for a in answers if a.code and "queue" in a.message.lower()]
            late = [a for a in answers if a.code and "deadline exceeded" in a.message]
            other = len(answers) - len(ok) - len(refused) - len(late)
            p = clients.point(clients_count, ok, wall)
            r = clients.point(clients_count, refused, wall)
            result.add(name, p, errors=len(answers) - len(ok), refused=len(refused),
                       late=len(late), other_errors=other, refused_p50_ms=r.p50_ms,
                       refused_p99_ms=r.p99_ms, admits=_admission(spec))
            result.summary.append(
                f"| `{name}` ({_admission(spec)}) | {clients_count} | {p.throughput:.0f} | "
                f"{p.p50_ms:.0f} / {p.p99_ms:.0f} | {len(refused)} | "
                + (f"{r.p50_ms:.0f} / {r.p99_ms:.0f}" if refused else "–")
                + f" | {len(late)} | {other} |")
    result.summary += [
        "",
        f"- `{SHEDDING_PIPELINE}` is `pipeline` with `max_inflight_requests` 8 and "
        "`max_queue_size` 16: sized so that what it admits is answered in about a second here. "
        "Beyond that it refuses at once, and what it admits keeps its latency. A refusal is not "
        "free: Triton still reads the 150 KB request, and here the retrying clients share the "
        "server's 2 cores.",
        "- The committed `pipeline` admits over 5 000 (sized for a GPU host): here, a thousand "
        "clients all wait, and what cannot be answered within the deadline fails late instead of "
        "being refused early. Size admission as throughput x acceptable wait "
        "(docs/configuration.md)."]
    result.plot = {"kind": "curve", "title": "Overload: answered/s vs p95 of answered requests"}
    return result


# -- 8. ONNX Runtime options of Triton's onnxruntime backend ---------------------------------------
# Each candidate is applied to every ONNX model that `pipeline` and `pipeline_ensemble` use,
# served under the committed names on a server of its own (so each run has the same processes),
# and both pipelines are measured at every level. The committed choice is
# spec.ORT_CPU_PARAMETERS; tests/unit/test_tuned_values.py keeps it equal to this run's winner.
ORT_CANDIDATES: dict[str, dict] = {
    # Triton's default: no parameters, so ONNX Runtime sizes each session's pools to the cores.
    "ORT defaults": {},
    "threads 1/1": {"parameters": dict(S.ORT_CPU_PARAMETERS)},
    "threads 2/1": {"parameters": {"intra_op_thread_count": "2", "inter_op_thread_count": "1"}},
    "threads 1/1, memory arena off": {"parameters": {**S.ORT_CPU_PARAMETERS,
                                                     "enable_mem_arena": "0"}},
    "threads 1/1, memory pattern off": {"parameters": {**S.ORT_CPU_PARAMETERS,
                                                       "enable_mem_pattern": "0"}},
    # ORT_ENABLE_BASIC (level -1) instead of the backend's default ORT_ENABLE_ALL.
    "threads 1/1, basic graph optimisation": {"parameters": dict(S.ORT_CPU_PARAMETERS),
                                              "optimization": {"graph": {"level": -1}}},
}
ORT_MODELS = (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER, S.POSTPROCESS)


def ort_candidate_config(model: S.ModelSpec, candidate: dict) -> str:
    """``model``'s config.pbtxt with the candidate's ONNX Runtime options in place of the
    committed ones (parsed through Triton's protobuf)."""
    from google.protobuf import text_format

    from modelgen import configs

    config = configs.config_dict(dataclasses.replace(model, parameters={}))
    if candidate.get("parameters"):
        config["parameters"] = {k: {"string_value": v} for k, v in candidate["parameters"].items()}
    if "optimization" in candidate:
        config["optimization"] = candidate["optimization"]
    return text_format.MessageToString(configs.to_proto(config))


def ort_options(ctx: Context) -> Result:
    import tempfile

    from modelgen import configs
    from tritonlocal import TritonServer, on_free_ports

    result = Result("ort_options", "ONNX Runtime options of Triton's onnxruntime backend (CPU)")
    names = (["ORT defaults", "threads 1/1"] if ctx.quick else list(ORT_CANDIDATES))
    levels = [2] if ctx.quick else [1, 4, 16]
    best: dict[str, dict[str, Point]] = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="ort-options-") as tmp:
            repo = Path(tmp) / "repo"
            for model in ORT_MODELS:
                (repo / model.name / "1").mkdir(parents=True)
                (repo / model.name / "config.pbtxt").write_text(
                    ort_candidate_config(model, ORT_CANDIDATES[name]))
                (repo / model.name / "1" / "model.onnx").symlink_to(
                    export.onnx_path(ctx.repository, model).resolve())
            variants.write(repo, S.PIPELINE)
            (repo / S.PIPELINE_ENSEMBLE.name / "1").mkdir(parents=True)
            (repo / S.PIPELINE_ENSEMBLE.name / "config.pbtxt").write_text(
                configs.render(S.PIPELINE_ENSEMBLE))
            with TritonServer(on_free_ports(repo, Path(tmp) / "tritonserver.log")) as server:
                for model in ("pipeline", "pipeline_ensemble"):
                    run = perf.run(model, server.grpc_url, levels, ctx.settings)
                    points = result.add_run(f"{model}: {name}", run, model=model, candidate=name)
                    if points:
                        best.setdefault(name, {})[model] = _best(points)
    result.summary += [
        f"Each candidate applied to {', '.join(m.name for m in ORT_MODELS)} (committed instance "
        f"counts and batching), on a server of its own; perf_analyzer over gRPC at concurrency "
        f"{levels}. Best throughput of each (req/s):", "",
        "| candidate | `pipeline` | `pipeline_ensemble` |", "|---|---|---|"]
    for name in names:
        cells = [best.get(name, {}).get(m) for m in ("pipeline", "pipeline_ensemble")]
        result.summary.append(f"| {name} | " + " | ".join(
            f"{p.throughput:.0f} (c={p.concurrency}, p95 {p.p95_ms:.0f} ms)" if p else "–"
            for p in cells) + " |")
    # The winner: the highest sum of both pipelines' best throughput.
    scored = {n: sum(p.throughput for p in b.values()) for n, b in best.items() if len(b) == 2}
    winner = max(scored, key=scored.get) if scored else None
    if winner:
        result.data = {"winner": winner, "parameters": ORT_CANDIDATES[winner].get("parameters", {}),
                       "optimization": ORT_CANDIDATES[winner].get("optimization", {}),
                       "throughput": {n: {m: round(p.throughput, 1) for m, p in b.items()}
                                      for n, b in best.items()}}
        base = scored.get("ORT defaults")
        result.summary += ["", f"- Winner (highest sum of both): **{winner}**"
                           + (f", {scored[winner] / base:.2f}× the sum with ONNX Runtime's defaults."
                              if base else "."),
                           "- The committed `spec.ORT_CPU_PARAMETERS` must equal the winner "
                           "(`tests/unit/test_tuned_values.py`); differences of a few percent are "
                           "within this machine's noise, so a candidate that adds a parameter "
                           "is kept only when it wins."]
    result.plot = {"kind": "curve", "title": "ONNX Runtime options: throughput vs p95",
                   "facet": "model"}
    return result


EXPERIMENTS = {
    "orchestration": orchestration,
    "fanout": fanout,
    "designs": concurrency_designs,
    "large_output": large_output,
    "clients": client_styles,
    "tuning": tuning,
    "overload": overload,
    "ort_options": ort_options,
    "overhead": overhead.overhead,
    "control_flow": control_flow.control_flow,
}
