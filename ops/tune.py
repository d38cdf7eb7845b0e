"""`make tune`: Triton Model Analyzer chooses the repository's instance counts and batching.

Model Analyzer (``model-analyzer profile``, pinned in the ``tune`` extra and installed in
``.venv-tune`` on first use) starts the same tritonserver, backends and repository as
``make serve`` (``--triton-launch-mode local``; a wrapper script adds what ``make serve`` adds:
the backend directory, the python backend's settings, the library path), loads each variant
of a model through the repository API and measures it with perf_analyzer. Per model:

- a stage model (ONNX): a brute search over ``STAGE_INSTANCES`` x ``STAGE_DELAYS_US``, every
  variant at ``STAGE_CONCURRENCY``, beside the committed config (``<model>_config_default``);
- a BLS orchestrator with its composing models (``--bls-composing-models``), or an ensemble:
  Model Analyzer's quick search over each model's instance count and max batch size.

The objective is throughput, under a p99 latency budget (``BUDGET_MS``). The chosen config of
a stage model is the highest throughput at concurrency ``COMPARE_AT`` whose p99 is within the
budget; ``spec.py`` commits it, and ``tests/tooling/test_tuned_values.py`` keeps the two equal.
What Model Analyzer does not search (ONNX Runtime's thread options, ``make bench-ort_options``;
max batch sizes and preferred batch sizes of the stage models) is kept, and the summary says so.

Results: ``bench/results/tuning/`` (the summary, ``summary.json``, each model's CSV); Model
Analyzer's checkpoints, variants, reports and server logs under ``bench/results/raw/tuning/``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bls_models import spec as S
from bls_models.repository import load_config
from tritonlocal import procs, runtime

ROOT = Path(__file__).resolve().parents[1]
MA_VENV = ROOT / ".venv-tune"
OUT = ROOT / "bench" / "results" / "tuning"
RAW = ROOT / "bench" / "results" / "raw" / "tuning"

STAGE_INSTANCES = (1, 2, 4)
STAGE_DELAYS_US = (100, 500, 2000)
STAGE_CONCURRENCY = (16,)
COMPARE_AT = 16
# p99 latency budgets on this 2-core CPU host at concurrency 16, in ms: a stage model's batch of
# 16 rows runs in tens of ms (the classifier ~9 ms a row on one thread); a pipeline's request
# costs ~30 ms of CPU, and its p99 at 16 in flight was 660-730 ms in every configuration Model
# Analyzer tried (a 600 ms budget stopped its search after 5). On a GPU host, give the
# service's own objective (--budget-ms).
BUDGET_MS = {"stage": 250.0, "composite": 1000.0}
BLS_COMPOSING = {S.PIPELINE.name: ("preprocess", "classifier", "embedder"),
                 S.TAG_PIPELINE.name: ("tagger_tags",),
                 S.DIGITS_CASCADE.name: ("digits_small", "digits_large")}
ENSEMBLES = (S.PIPELINE_ENSEMBLE.name, S.DIGITS_ENSEMBLE.name)
# `make tune` without MODEL: the stage models worth tuning (microsecond models are not), the
# image pipeline with its composing models, and the ensemble it is compared with.
DEFAULT_MODELS = ("preprocess", "classifier", "embedder", "digits_large", "pipeline",
                  "pipeline_ensemble")
# perf_analyzer's measurement: time windows like bench/perf.py's (Model Analyzer's default count
# windows ignore the interval), shorter and less strict, and at most MAX_AUTO_ADJUSTS longer
# retries of an unstable one (Model Analyzer's default, 10, took 70 s for one point here): the
# whole repository within 30 minutes on this host.
MEASUREMENT = {"measurement-mode": "time_windows", "measurement-interval": "2000",
               "stability-percentage": "25", "max-trials": "6"}
MAX_AUTO_ADJUSTS = 2
SMOKE_MEASUREMENT = {"measurement-mode": "time_windows", "measurement-interval": "500",
                     "stability-percentage": "1000", "max-trials": "4"}


def kind(model: str) -> str:
    return "bls" if model in BLS_COMPOSING else "ensemble" if model in ENSEMBLES else "stage"


def budget(model: str, given: float | None) -> float:
    return given if given is not None else BUDGET_MS["stage" if kind(model) == "stage"
                                                     else "composite"]


# -- the server Model Analyzer starts ----------------------------------------------------------
def server_wrapper(run: Path, gpu: bool) -> Path:
    """``run/tritonserver``: the wheel's tritonserver with what `make serve` gives it besides
    the flags Model Analyzer sets itself (repository, explicit model control, ports)."""
    from tritonlocal import backend_build, flags, launcher

    install = runtime.find_installation()
    python = str(ROOT / ".venv" / "bin" / "python")
    version, _ = runtime.python_version_of(python)
    built = backend_build.installed(gpu=gpu)
    if built is None:
        raise SystemExit(f"the onnxruntime backend is not built: run `make backend{'-gpu' * gpu}`")
    backends = run / "backends"
    launcher.assemble_backends(install, install.stub(version), Path(built), backends)
    env = runtime.server_environment(install, python)
    extra = [f"--backend-directory={backends}", "--allow-cpu-metrics=true",
             f"--allow-gpu-metrics={str(gpu).lower()}",
             *(a for a in flags.serving_flags() if a.startswith("--backend-config")),
             *(flags.cuda_pool_flags() if gpu else ["--pinned-memory-pool-byte-size=0"])]
    library_path = env["LD_LIBRARY_PATH"]
    if gpu:
        library_path = launcher.gpu_library_path(library_path)
    script = run / "tritonserver"
    script.write_text("#!/bin/sh\n# Model Analyzer's tritonserver: the wheel's, served as `make serve` "
                      "serves it.\n"
                      f"export LD_LIBRARY_PATH='{library_path}'\n"
                      f"export PATH='{Path(python).parent}':\"$PATH\"\n"
                      "unset PYTHONPATH PYTHONHOME\n"
                      f"exec '{install.server}' \"$@\" " + " ".join(f"'{a}'" for a in extra) + "\n")
    script.chmod(0o755)
    return script


# -- the Model Analyzer config -------------------------------------------------------------------
def ma_config(model: str, run: Path, repository: Path, server: Path, ports: dict[str, int],
              budget_ms: float, gpu: bool, smoke: bool) -> dict:
    """Model Analyzer's YAML config (as a dict) for ``model``."""
    config = {
        "model_repository": str(repository),
        "triton_launch_mode": "local",
        "triton_server_path": str(server),
        "triton_http_endpoint": f"127.0.0.1:{ports['http']}",
        "triton_grpc_endpoint": f"127.0.0.1:{ports['grpc']}",
        "triton_metrics_url": f"http://127.0.0.1:{ports['metrics']}/metrics",
        "triton_output_path": str(run / "tritonserver.log"),
        "perf_analyzer_path": str(ROOT / ".venv" / "bin" / "perf_analyzer"),
        # Two cores: perf_analyzer's threads may use more than the 80 % Model Analyzer allows.
        "perf_analyzer_cpu_util": 400,
        "perf_analyzer_max_auto_adjusts": MAX_AUTO_ADJUSTS,
        "perf_analyzer_flags": dict(SMOKE_MEASUREMENT if smoke else MEASUREMENT),
        "client_protocol": "grpc",
        "checkpoint_directory": str(run / "checkpoints"),
        "export_path": str(run / "export"),
        "output_model_repository_path": str(run / "variants"),
        "override_output_model_repository": True,
        "skip_detailed_reports": True,
        "objectives": {"perf_throughput": 10},
        "constraints": {"perf_latency_p99": {"max": budget_ms}},
        "inference_output_fields": ["model_name", "batch_size", "concurrency",
                                    "model_config_path", "instance_group", "max_batch_size",
                                    "satisfies_constraints", "perf_throughput",
                                    "perf_latency_p95", "perf_latency_p99"],
    }
    data = input_data(model, run)
    if data:
        config["perf_analyzer_flags"].update(data)
    # The orchestrators are KIND_CPU in every profile: they compute nothing on a GPU.
    spec = {"cpu_only": not gpu or kind(model) == "bls"}
    if kind(model) == "stage":
        instances = (1, 2) if smoke else STAGE_INSTANCES
        delays = (S.model(model).batching.max_queue_delay_us,) if smoke else STAGE_DELAYS_US
        spec["model_config_parameters"] = {
            "instance_group": [{"kind": "KIND_GPU" if gpu else "KIND_CPU",
                                "count": list(instances)}],
            "dynamic_batching": {"max_queue_delay_microseconds": list(delays)}}
        spec["parameters"] = {"concurrency": [COMPARE_AT] if smoke else list(STAGE_CONCURRENCY)}
        config["run_config_search_disable"] = True
    else:
        composing = (BLS_COMPOSING.get(model)
                     or tuple(step.model for step in S.model(model).ensemble_steps))
        config["run_config_search_mode"] = "quick"
        if kind(model) == "bls":
            config["bls_composing_models"] = list(composing)
        if not gpu:
            config["cpu_only_composing_models"] = list(composing)
        # The orchestrators size their sub-requests from the stage configs on disk: no variant
        # may take fewer rows than those (and the committed preferred sizes must stay legal).
        committed = max(max_batch_size(repository, name) for name in (model, *composing))
        config["run_config_search_min_model_batch_size"] = committed
        config["run_config_search_max_model_batch_size"] = 2 * committed
        config["run_config_search_max_instance_count"] = 4
        # Quick search loads each configuration at 2 x max batch x instances requests in flight
        # (64 and more here), where no configuration of `pipeline` met a 600 ms p99 on this host
        # and the search stopped after 3. Every configuration at COMPARE_AT instead.
        config["run_config_search_min_concurrency"] = COMPARE_AT
        config["run_config_search_max_concurrency"] = COMPARE_AT
        # The committed config is measured at Model Analyzer's own concurrency; the final sweep
        # of the best configurations (here: only COMPARE_AT) measures them at the compared one.
        config["concurrency_sweep_disable"] = False
    config["profile_models"] = {model: spec}
    return config


def known(model: str):
    """The repository's spec of ``model``, or None for a user's own (docs/extending.md)."""
    try:
        return S.model(model)
    except KeyError:
        return None


def max_batch_size(repository: Path, model: str) -> int:
    """``model``'s committed max batch size: its spec's, or its config.pbtxt's (a user's own)."""
    spec = known(model)
    if spec is not None:
        return spec.max_batch_size
    return load_config(repository / model / "config.pbtxt").max_batch_size


def input_data(model: str, run: Path) -> dict[str, str]:
    """perf_analyzer input flags where random data would not be the model's real work: token ids
    within the vocabulary for the taggers, real digits (the cascade's branch depends on them)."""
    if model.startswith("tag"):
        return {"shape": f"TOKENS:{S.TAGGER_SEQ_LEN}", "input-data": "zero"}
    if S.DIGIT_PIXELS in getattr(known(model), "inputs", ()):
        from modelgen import digits

        pixels = digits.split()[1]
        path = run / "digits.json"
        path.write_text(json.dumps({"data": [{S.DIGIT_PIXELS.name: [float(v) for v in row]}
                                             for row in pixels[:64]]}))
        return {"input-data": str(path)}
    return {}


# -- running it ------------------------------------------------------------------------------------
def ensure_model_analyzer() -> Path:
    binary = MA_VENV / "bin" / "model-analyzer"
    if not binary.exists():
        raise SystemExit("Model Analyzer is not installed: `make tune` installs it into "
                         f"{MA_VENV.name} (pip install '.[tune]')")
    return binary


PROGRESS = re.compile(r"(Profiling \S+:.*|Creating model config: \S+)")


def profile(model: str, run: Path, config: dict, log) -> int:
    """Run ``model-analyzer profile`` on ``config``; a line per variant on stdout."""
    import yaml

    path = run / "model-analyzer.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [str(ensure_model_analyzer()), "profile", "-f", str(path)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    started = time.monotonic()
    variants = 0
    # Model Analyzer's tritonserver and perf_analyzer go with it when this run is stopped
    # (SIGINT, SIGTERM) or fails.
    with subprocess.Popen(command, cwd=run, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as process, _stopped_on_exit(process, run.parent):
        for line in process.stdout:
            log.write(line)
            found = PROGRESS.search(line)
            if found:
                profiling = found.group(1).startswith("Profiling")
                variants += profiling
                print(f"[tune {model} {time.monotonic() - started:6.0f} s] "
                      f"{f'#{variants}' if profiling else '  '} {found.group(1)}", flush=True)
    return process.returncode


@contextlib.contextmanager
def _stopped_on_exit(process: subprocess.Popen, base: Path):
    """On the way out (done, failed, or stopped: ``run_as_program`` turns SIGTERM and SIGINT
    into KeyboardInterrupt), Model Analyzer is asked to stop (SIGINT: it stops its server and
    keeps its checkpoint), and whatever it started is then terminated: it starts tritonserver
    and perf_analyzer in sessions of their own, so they are found by the run's directory (the
    server's backend directory, perf_analyzer's working directory)."""
    try:
        yield
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = started_under(base)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while left and time.monotonic() < deadline:
                time.sleep(0.2)
                left = started_under(base)
            if not left:
                break


def started_under(base: Path) -> list[int]:
    """Processes other than this one whose command line or working directory names ``base``."""
    found = []
    for proc in procs.processes():
        if proc.pid == os.getpid() or not proc.argv:
            continue
        try:
            where = os.readlink(f"/proc/{proc.pid}/cwd")
        except OSError:
            continue
        if str(base).encode() in b" ".join(proc.argv) or where.startswith(str(base)):
            found.append(proc.pid)
    return found


@dataclass
class Measured:
    variant: str          # the profiled model's variant, e.g. classifier_config_3
    composing: list[str]  # the composing models' variants it ran with (BLS, ensembles)
    concurrency: int
    throughput: float
    p99_ms: float
    within: bool
    settings: dict        # the profiled variant's instances and batching

    @property
    def configuration(self) -> str:
        return " + ".join([self.variant, *self.composing])


def measurements(run: Path, model: str, budget_ms: float) -> list[Measured]:
    """Every measurement Model Analyzer kept for ``model`` (its checkpoint: a variant, the
    composing variants it ran with, perf_analyzer's figures), each with its variant's settings
    (read from the variant's config.pbtxt)."""
    (checkpoint,) = sorted((run / "checkpoints").glob("*.ckpt"))[-1:]
    results = json.loads(checkpoint.read_text())["ResultManager.results"]["_results"]
    rows = []
    for variant, (_, kept) in results.get(model, {}).items():
        for key, measurement in kept.items():
            composing = key.rsplit(" ", 1)[-1].split(",") if kind(model) != "stage" else []
            (own,) = [m for m in measurement["_model_config_measurements"]
                      if m["_model_config_name"] == model]
            figures = {name: value["_value"] for name, value in own["_non_gpu_data"]}
            p99 = float(figures["perf_latency_p99"])
            rows.append(Measured(variant, composing,
                                 int(own["_model_specific_pa_params"]["concurrency-range"]),
                                 float(figures["perf_throughput"]), p99, p99 <= budget_ms,
                                 variant_settings(run / "variants" / variant)))
    return rows


def variant_settings(directory: Path) -> dict:
    config = load_config(directory / "config.pbtxt")
    return {"instance_count": sum(g.count for g in config.instance_group) or None,
            "max_batch_size": config.max_batch_size,
            "max_queue_delay_us": config.dynamic_batching.max_queue_delay_microseconds,
            "preferred_batch_sizes": list(config.dynamic_batching.preferred_batch_size)}


def choose(rows: list[Measured], model: str) -> tuple[Measured | None, Measured | None]:
    """(committed, chosen) at ``COMPARE_AT``: the committed configuration's row, and the
    configuration of highest throughput within the budget."""
    default = f"{model}_config_default"
    rows = [r for r in rows if r.concurrency == COMPARE_AT]
    committed = max((r for r in rows if r.variant == default
                     and all(c.endswith("_config_default") for c in r.composing)),
                    key=lambda r: r.throughput, default=None)
    within = [r for r in rows if r.within]
    return committed, max(within, key=lambda r: r.throughput, default=None)


def describe(settings: dict) -> str:
    parts = []
    if settings.get("instance_count"):
        parts.append(f"{settings['instance_count']} inst")
    parts.append(f"max batch {settings['max_batch_size']}")
    if settings.get("max_queue_delay_us") or settings.get("preferred_batch_sizes"):
        parts.append(f"delay {settings['max_queue_delay_us']} µs")
        preferred = ",".join(map(str, settings["preferred_batch_sizes"])) or "none"
        parts.append(f"preferred {preferred}")
    return ", ".join(parts)


def collect(model: str, run: Path, out: Path, budget_ms: float, seconds: float) -> dict:
    """Copy Model Analyzer's table and summary report for ``model`` into ``out``; return its
    outcome for summary.json."""
    rows = measurements(run, model, budget_ms)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{model}.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["variant", "composing", "concurrency", "throughput_infer_per_s",
                         "p99_ms", "within_budget", "instance_count", "max_batch_size",
                         "max_queue_delay_us", "preferred_batch_sizes", "composing_settings"])
        for r in sorted(rows, key=lambda r: -r.throughput):
            s = r.settings
            writer.writerow([r.variant, " ".join(r.composing), r.concurrency, r.throughput,
                             r.p99_ms, r.within, s["instance_count"], s["max_batch_size"],
                             s["max_queue_delay_us"],
                             " ".join(map(str, s["preferred_batch_sizes"])),
                             "; ".join(f"{c}: {describe(variant_settings(run / 'variants' / c))}"
                                       for c in r.composing)])
    report = run / "export" / "reports" / "summaries" / model
    if report.is_dir():
        target = out / f"{model}-report"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(report, target)
    committed, chosen = choose(rows, model)
    configurations = {r.configuration for r in rows}
    return {"kind": kind(model), "budget_p99_ms": budget_ms, "seconds": round(seconds),
            "variants": len(configurations),
            "variants_within_budget": len({r.configuration for r in rows if r.within}),
            "committed": _outcome(committed), "chosen": _outcome(chosen)}


def _outcome(row: Measured | None) -> dict | None:
    if row is None:
        return None
    return {"variant": row.variant, "composing": row.composing, "concurrency": row.concurrency,
            "throughput": row.throughput, "p99_ms": row.p99_ms, **row.settings}


def write_summary(out: Path, results: dict, meta: dict) -> Path:
    summary = out / "summary.json"
    known = json.loads(summary.read_text())["models"] if summary.exists() else {}
    known.update(results)
    summary.write_text(json.dumps({**meta, "models": known}, indent=2) + "\n")
    runs = sorted({(r["run"]["when"], r["run"]["commit"], r["run"]["command"])
                   for r in known.values()})
    lines = ["# Tuning by Triton Model Analyzer (`make tune`)", "",
             "Runs: " + "; ".join(f"{when} at commit `{commit}`: `{command}`"
                                  for when, commit, command in runs) + ". "
             "Objective: throughput; constraint: p99 within the budget. Stage models: a brute "
             f"search over instances {list(STAGE_INSTANCES)} x max_queue_delay_microseconds "
             f"{list(STAGE_DELAYS_US)} at concurrency {list(STAGE_CONCURRENCY)}, chosen at "
             f"concurrency {COMPARE_AT}; composite models (BLS with their composing models, "
             f"ensembles): Model Analyzer's quick search over instances and max batch sizes, each "
             f"configuration at concurrency {COMPARE_AT}. "
             "Every row of every variant: `<model>.csv`; Model Analyzer's own summary: "
             "`<model>-report/`.", "",
             "| model | budget p99 (ms) | variants (within budget) | committed | throughput, p99 |"
             " chosen | throughput, p99 | chosen / committed |",
             "|---|---|---|---|---|---|---|---|"]
    for model, r in known.items():
        c, w = r["committed"], r["chosen"]

        def describe_all(x):
            return describe(x) + (f" (with {', '.join(x['composing'])})" if x.get("composing")
                                  else "")

        def cell(x):
            return (f"{x['throughput']:.1f}/s, {x['p99_ms']:.0f} ms (c={x['concurrency']})"
                    if x else "–")
        ratio = f"{w['throughput'] / c['throughput']:.2f}" if c and w else "–"
        lines.append(f"| {model} | {r['budget_p99_ms']:g} | {r['variants']} "
                     f"({r['variants_within_budget']}) | {describe_all(c) if c else '–'} | {cell(c)} |"
                     f" {('**' + describe_all(w) + '**') if w else 'none within budget'} | {cell(w)}"
                     f" | {ratio} |")
    (out / "SUMMARY.md").write_text("\n".join(lines) + "\n")
    return summary


def _composing(text: str) -> tuple[str, tuple[str, ...]]:
    model, _, composing = text.partition("=")
    if not model or not composing:
        raise argparse.ArgumentTypeError(f"'{text}': give BLS=A,B (the models it calls)")
    return model, tuple(name for name in composing.split(",") if name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="a model to tune (repeatable); "
                        f"default: {', '.join(DEFAULT_MODELS)}")
    parser.add_argument("--composing", type=_composing, action="append", metavar="BLS=A,B",
                        help="a BLS model of your own (docs/extending.md) and the models it "
                        "calls, e.g. image_embedding=preprocess,embedder,classifier")
    parser.add_argument("--budget-ms", type=float, help="p99 budget in ms (default: "
                        f"{BUDGET_MS['stage']:g} for stage models, {BUDGET_MS['composite']:g} "
                        "for BLS and ensembles)")
    parser.add_argument("--profile", choices=("cpu", "gpu", "gpu-ort-trt", "gpu-trt"),
                        default="cpu", help="cpu: the committed repository; a GPU profile: "
                        "its rendering (modelgen.profiles), on KIND_GPU")
    parser.add_argument("--smoke", action="store_true",
                        help="a minimal search with short windows (tests; no claims)")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository",
                        help="the repository to tune (default: the project's; never written)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--raw", type=Path, default=RAW)
    parser.add_argument("--dry-run", action="store_true",
                        help="write Model Analyzer's configs and the server wrapper, run nothing")
    args = parser.parse_args(argv)
    models = args.model or ([] if args.composing else list(DEFAULT_MODELS))
    for model, composing in args.composing or []:
        BLS_COMPOSING[model] = composing
        models.append(model)
    for model in models:
        if model not in BLS_COMPOSING:
            S.model(model)  # an unknown name fails here, with the known ones
    gpu = args.profile != "cpu"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = args.raw / stamp
    base.mkdir(parents=True, exist_ok=True)
    repository = args.repository.resolve()
    if gpu:
        from modelgen import profiles

        repository = base / f"repository-{args.profile}"
        profiles.write(args.profile, args.repository.resolve(), repository)
    # A dry run only writes Model Analyzer's configs (a GPU profile's backend may not be built).
    server = base / "tritonserver" if args.dry_run else server_wrapper(base, gpu)
    from bench.report import started

    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": started()["commit"], "profile": args.profile, "smoke": args.smoke,
            "command": "python -m ops.tune " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])}
    results, failed = {}, []
    for model in models:
        run = base / model
        run.mkdir()
        limit = budget(model, args.budget_ms)
        ports = dict(zip(("http", "grpc", "metrics"), runtime.free_ports(3)))
        config = ma_config(model, run, repository, server, ports, limit, gpu, args.smoke)
        if args.dry_run:
            import yaml

            (run / "model-analyzer.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            print(f"[tune] {model}: {run / 'model-analyzer.yaml'}")
            continue
        print(f"[tune] {model} ({kind(model)}, p99 budget {limit:g} ms): Model Analyzer log "
              f"{run / 'model-analyzer.log'}", flush=True)
        started_at = time.monotonic()
        with (run / "model-analyzer.log").open("w") as log:
            code = profile(model, run, config, log)
        table = run / "export" / "results" / "metrics-model-inference.csv"
        if code != 0 or not table.exists():
            failed.append(model)
            print(f"[tune] {model}: Model Analyzer failed (exit {code}); see "
                  f"{run / 'model-analyzer.log'}", flush=True)
            continue
        results[model] = {**collect(model, run, args.out, limit, time.monotonic() - started_at),
                          "run": {key: meta[key] for key in ("when", "commit", "command")},
                          "raw": str(run.relative_to(ROOT) if run.is_relative_to(ROOT) else run)}
        r = results[model]
        print(f"[tune] {model}: {r['variants']} variants in {r['seconds']} s; chosen: "
              f"{describe(r['chosen']) if r['chosen'] else 'none within budget'}", flush=True)
    if results:
        print(f"[tune] summary: {write_summary(args.out, results, meta)}")
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
