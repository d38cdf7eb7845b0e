"""The benchmark experiments. Each takes a ``Context`` (a running server and settings) and returns
a ``Result``: rows for the CSV, a summary (ratios against the targets) and the command lines.

Everything one experiment compares is measured in the same run, side by side, because the
machine is shared and noisy: ratios are meaningful, absolute numbers much less so.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import clients, designs, perf
from bench.perf import Point
from bls_models import spec as S
from modelgen import export, nets, variants

SHM_OUTPUT_BYTES = 4 * 512 * 14041 + 1024  # one tagger output (28.7 MB) for perf_analyzer's shm


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

    def add(self, variant: str, point: Point, protocol: str = "grpc", errors: int = 0, **extra):
        self.rows.append({"experiment": self.name, "variant": variant, "protocol": protocol,
                          **dataclasses.asdict(point), "errors": errors, **extra})

    def add_run(self, variant: str, run: perf.Run, protocol: str = "grpc") -> list[Point]:
        self.commands.append(run.command_line)
        if run.error:
            self.summary.append(f"- **{variant}: perf_analyzer failed**: {run.error}")
        for p in run.points:
            self.add(variant, p, protocol)
        return run.points


# -- variants the experiments need beside the committed repository ---------------------------------
def variant_specs(repository: Path) -> list[tuple[S.ModelSpec, str]]:
    """(spec, base) pairs: base is the committed model whose code or ONNX file the variant uses."""
    sequential = dataclasses.replace(S.PIPELINE, name="pipeline_sequential",
                                     parameters={**S.PIPELINE.parameters, "fanout": "sequential",
                                                 "stage_model_repositories": str(repository)})
    taggers = [dataclasses.replace(S.TAGGER, name=f"tagger_delay_{label}",
                                   batching=dataclasses.replace(S.TAGGER.batching,
                                                                max_queue_delay_us=delay))
               for label, delay in (("100ms", 100_000), ("100us", 100))]
    return ([(sequential, "pipeline")] + [(t, "tagger") for t in taggers]
            + [(d, "pipeline") for d in designs.design_specs(repository)])


def build_variants(target: Path, repository: Path) -> Path:
    """Fault models (the designs use them) and the benchmark variants, in ``target``."""
    variants.build(target, repository, variants=())
    return write_variants(target, repository)


def write_variants(target: Path, repository: Path) -> Path:
    for spec, base in variant_specs(repository):
        if spec.backend == "onnxruntime":
            variants.write_onnx(target, spec, export.onnx_path(repository, S.model(base)))
        else:
            variants.write(target, spec, repository / base / "1" / "model.py")
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
def orchestration(ctx: Context) -> Result:
    result = Result("orchestration", "Cost of orchestration: the same work four ways")
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
    bls = result.add_run("BLS pipeline", perf.run("pipeline", url, levels, ctx.settings))
    ens = result.add_run("ensemble", perf.run("pipeline_ensemble", url, levels, ctx.settings))

    best = {name: _best(points) for name, points in
            (("in-process", inproc), ("direct", direct), ("bls", bls), ("ensemble", ens))}
    tp = {k: (v.throughput if v else None) for k, v in best.items()}
    one = {k: _at(points, 1) for k, points in
           (("in-process", inproc), ("direct", direct), ("bls", bls), ("ensemble", ens))}
    c16 = {k: _at(points, 16) for k, points in (("bls", bls), ("ensemble", ens))}
    result.summary += [
        "| way | best throughput (req/s) | at concurrency | p50 at concurrency 1 (ms) |",
        "|---|---|---|---|",
        *[f"| {label} | {best[k].throughput:.0f} | {best[k].concurrency} | "
          f"{one[k].p50_ms:.2f} |" for k, label in
          (("in-process", "in-process onnxruntime"), ("direct", "client calls sub-models"),
           ("bls", "BLS `pipeline`"), ("ensemble", "`pipeline_ensemble`")) if best[k] and one[k]],
        "",
        _target("BLS / ensemble throughput (best concurrency)",
                tp["bls"] / tp["ensemble"] if tp["bls"] and tp["ensemble"] else None, 0.9, "higher"),
        _target("BLS / in-process throughput (best concurrency)",
                tp["bls"] / tp["in-process"] if tp["bls"] and tp["in-process"] else None, 0.8, "higher"),
        _target("BLS / ensemble p95 at concurrency 16",
                c16["bls"].p95_ms / c16["ensemble"].p95_ms if c16["bls"] and c16["ensemble"] else None,
                1.2, "lower"),
    ]
    if one["bls"] and one["in-process"] and one["ensemble"]:
        added_bls = one["bls"].p50_ms - one["in-process"].p50_ms
        added_ens = one["ensemble"].p50_ms - one["in-process"].p50_ms
        result.summary += [
            f"- Latency added over in-process at concurrency 1: BLS {added_bls:.2f} ms over 4 hops "
            f"(client→pipeline, 3 sub-requests) = **{added_bls / 4:.2f} ms per hop**; ensemble "
            f"{added_ens:.2f} ms over 5 hops (client→ensemble, 4 steps) = {added_ens / 5:.2f} ms per hop.",
        ]
    result.plot = {"kind": "curve", "title": "Throughput vs p95 latency (concurrency sweep)"}
    return result


# -- 2. async fan-out vs sequential -----------------------------------------------------------------
def fanout(ctx: Context) -> Result:
    result = Result("fanout", "Async fan-out vs sequential branches (concurrency 1)")
    url = ctx.server.grpc_url
    points = {}
    for label, model in (("concurrent fan-out (`pipeline`)", "pipeline"),
                         ("sequential (`pipeline_sequential`)", "pipeline_sequential")):
        points[model] = (result.add_run(label, perf.run(model, url, [1], ctx.settings)) or [None])[0]
    stages = {}
    for model in ("preprocess", "classifier", "embedder"):
        extra = ["--input-data", "zero"] if model != "preprocess" else []
        stages[model] = (result.add_run(f"`{model}` alone", perf.run(model, url, [1], ctx.settings,
                                                                     extra=extra)) or [None])[0]
    concurrent, sequential = points["pipeline"], points["pipeline_sequential"]
    ratio = concurrent.p50_ms / sequential.p50_ms if concurrent and sequential else None
    result.summary.append(_target("p50 concurrent / sequential", ratio, 0.6, "lower"))
    if all(stages.values()):
        a, b = stages["classifier"].p50_ms, stages["embedder"].p50_ms
        pre = stages["preprocess"].p50_ms
        result.summary.append(
            f"- Expected from the stages alone (p50, each over its own client hop): "
            f"max(a,b)/(a+b) = {max(a, b) / (a + b):.2f}; with preprocess in both, "
            f"(pre + max)/(pre + a + b) = {(pre + max(a, b)) / (pre + a + b):.2f} "
            f"(pre {pre:.2f} ms, classifier {a:.2f} ms, embedder {b:.2f} ms).")
    result.plot = {"kind": "bars", "title": "p50 latency at concurrency 1 (ms)"}
    return result


# -- 3. orchestrator concurrency designs ----------------------------------------------------------
def concurrency_designs(ctx: Context) -> Result:
    result = Result("designs", "Orchestrator concurrency designs")
    levels = [1, 4] if ctx.quick else [1, 16, 64, 256]
    url = ctx.server.grpc_url
    image = nets.synthetic_images(1, seed=1).numpy()
    result.summary += ["| design | 50 requests behind slow ones: p50 / max (ms) | unanswered |",
                       "|---|---|---|"]
    for design in designs.DESIGNS:
        fast, missing = designs.head_of_line(url, design, image)
        hol = clients.point(50, fast, 1.0)
        result.add(design.name, hol, errors=missing, scenario="head-of-line")
        result.summary.append(f"| {design.name} | {hol.p50_ms:.0f} / {max(fast, default=0) * 1e3:.0f} "
                              f"| {missing} |")
        extra = ["--async"] + (["--streaming"] if design.decoupled else [])
        run = perf.run(design.model, url, levels, ctx.settings, extra=extra)
        result.commands.append(run.command_line)
        if run.error:
            result.summary.append(f"| {design.name}: perf_analyzer failed: {run.error} | | |")
        for p in run.points:
            result.add(design.name, p, scenario="throughput")
    result.plot = {"kind": "curve", "title": "Designs: throughput vs p95 latency",
                   "filter": {"scenario": "throughput"}}
    return result


# -- 4. the large-output case ---------------------------------------------------------------------
def large_output(ctx: Context) -> Result:
    result = Result("large_output", "The large-output case (tagger, 28.7 MB per sequence), concurrency 1")
    url_grpc, url_http = ctx.server.grpc_url, ctx.server.http_url
    zero = ["--input-data", "zero"]  # token 0 is valid; random INT64 would not be
    shm = ["--shared-memory", "system", "--output-shared-memory-size", str(SHM_OUTPUT_BYTES)]
    cases = [
        ("`tagger` over HTTP", "tagger", url_http, "http", zero),
        ("`tagger` over gRPC", "tagger", url_grpc, "grpc", zero),
        ("`tagger` over gRPC + system shared memory", "tagger", url_grpc, "grpc", zero + shm),
        ("`tag_pipeline` (reduced on the server), gRPC", "tag_pipeline", url_grpc, "grpc", zero),
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
    result.summary += ["| case | p50 (ms) | × in-process |", "|---|---|---|"]
    for label in [c[0] for c in cases]:
        if p50[label]:
            result.summary.append(f"| {label} | {p50[label]:.1f} | {p50[label] / inproc.p50_ms:.2f} |")
    result.summary.append(f"| in-process onnxruntime `tagger` | {inproc.p50_ms:.1f} | 1.00 |")
    tag = p50.get("`tag_pipeline` (reduced on the server), gRPC")
    result.summary.append("")
    result.summary.append(_target("`tag_pipeline` p50 / in-process `tagger` p50",
                                  tag / inproc.p50_ms if tag else None, 1.25, "lower"))
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
        run = perf.run("pipeline", url, [c], ctx.settings, extra=["--async"])
        for p in result.add_run("perf_analyzer --async", run):
            result.summary.append(f"| perf_analyzer --async | {c} | (time windows) | {p.throughput:.0f} | "
                                  f"{p.p50_ms:.0f} / {p.p95_ms:.0f} / {p.p99_ms:.0f} | 0 | 0 |")
    result.plot = {"kind": "curve", "title": "Clients: throughput vs p95 latency"}
    return result


# -- 6. tuning ----------------------------------------------------------------------------------
TUNING_DELAYS_US = (100, 500, 2000)
TUNING_INSTANCES = (1, 2, 4)
TUNING_LEVELS = (4, 16)
# p95 budget per sub-model at the highest tuning concurrency: a pipeline request crosses
# preprocess and then the slower of classifier/embedder.
TUNING_BUDGET_MS = {"preprocess": 20.0, "classifier": 40.0, "embedder": 40.0}


def tuning(ctx: Context) -> Result:
    """Sweep max_queue_delay_microseconds x instance count per sub-model, each variant on a
    server of its own model's variants, and pick the highest throughput within the budget."""
    import itertools
    import tempfile

    from tritonlocal import ServerOptions, TritonServer
    from tritonlocal.runtime import free_ports

    result = Result("tuning", "Tuning: batching delay and instance count per sub-model")
    models = [S.CLASSIFIER] if ctx.quick else [S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER]
    grid = ([(500, 1), (500, 2)] if ctx.quick
            else list(itertools.product(TUNING_DELAYS_US, TUNING_INSTANCES)))
    levels = [4] if ctx.quick else list(TUNING_LEVELS)
    top = levels[-1]
    result.summary += [f"Grid: max_queue_delay_microseconds {sorted({d for d, _ in grid})} × "
                       f"instances {sorted({i for _, i in grid})}; preferred batch sizes as "
                       f"committed; perf_analyzer at concurrency {levels}; winner = highest "
                       f"throughput at concurrency {top} whose p95 is within the budget.", "",
                       "| model | committed (delay µs, instances) | winner | throughput (req/s) "
                       "| p95 (ms) | budget (ms) |", "|---|---|---|---|---|---|"]
    for model in models:
        specs = {(d, i): dataclasses.replace(
                    model, name=f"{model.name}__d{d}_i{i}", instance_count=i,
                    batching=dataclasses.replace(model.batching, max_queue_delay_us=d))
                 for d, i in grid}
        with tempfile.TemporaryDirectory(prefix="tuning-") as tmp:
            repo = Path(tmp) / "repo"
            for spec in specs.values():
                variants.write_onnx(repo, spec, export.onnx_path(ctx.repository, model))
            http, grpc, metrics = free_ports(3)
            options = ServerOptions(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                    log_file=Path(tmp) / "tritonserver.log")
            candidates = []
            with TritonServer(options) as server:
                for (delay, instances), spec in specs.items():
                    run = perf.run(spec.name, server.grpc_url, levels, ctx.settings)
                    result.commands.append(run.command_line)
                    for p in run.points:
                        result.add(f"{model.name} delay={delay}us instances={instances}", p,
                                   model=model.name, delay_us=delay, instances=instances)
                        if p.concurrency == top:
                            candidates.append((delay, instances, p))
        budget = TUNING_BUDGET_MS[model.name]
        within = [c for c in candidates if c[2].p95_ms <= budget]
        committed = f"{model.batching.max_queue_delay_us}, {model.instance_count}"
        if within:
            delay, instances, p = max(within, key=lambda c: c[2].throughput)
            result.summary.append(f"| {model.name} | {committed} | {delay}, {instances} | "
                                  f"{p.throughput:.0f} | {p.p95_ms:.1f} | {budget:.0f} |")
        else:
            result.summary.append(f"| {model.name} | {committed} | none within budget | | | "
                                  f"{budget:.0f} |")
    result.summary += ["", "On a GPU host, `make bench-tuning` runs the same grid with the "
                       "instances on the GPUs (KIND_AUTO); apply winners in `bls_models/spec.py` "
                       "and `make configs`."]
    result.plot = {"kind": "curve", "title": "Tuning: throughput vs p95 per variant"}
    return result


EXPERIMENTS = {
    "orchestration": orchestration,
    "fanout": fanout,
    "designs": concurrency_designs,
    "large_output": large_output,
    "clients": client_styles,
    "tuning": tuning,
}
