"""`make bench-control_flow`: what an ensemble does that `pipeline` now does too, and what only a
BLS can do.

- **Pruning.** `pipeline` and `pipeline_ensemble` asked for "classes only", "embedding only"
  and "all outputs": throughput at concurrency ``CONCURRENCY`` and the sub-requests each stage
  received per client request (Triton's ``nv_inference_request_success``), in both regimes —
  the committed CNNs (the benchmark's server) and the fast sub-models that stand for a GPU (a
  server of its own over ``overhead.fast_repository``). The load is the project's asyncio gRPC
  client: perf_analyzer always asks for every output.
- **Windowing.** Tokens per second for documents of 512, 2 048 and 8 192 tokens through
  `tag_pipeline` (windows cut and stitched in the orchestrator), against a client that cuts the
  same windows, sends each as a separate 512-token request at the same concurrency and stitches
  the answers itself — to `tag_pipeline` (what a client had to do before) and to `tagger_tags`
  directly (no orchestrator hop at all).
- **Cascade.** On the held-out split of the digits: accuracy of `digits_small` alone,
  `digits_large` alone and `digits_cascade` at three thresholds, the share of rows escalated,
  and throughput at concurrency 16 of each and of `digits_ensemble` (both models, always).

`CONTROL_FLOW_PARTS=cascade make bench-control_flow` measures the cascade alone (ten minutes
less; its report then lacks the other parts).

Rounds are interleaved so that a slow spell of this shared 2-core host hits every subject alike;
the figures are the medians of the rounds.
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench import overhead
from bench.common import Context, Result, target_line
from bls_models import pipelines
from bls_models import spec as S
from modelgen import nets
from tritonlocal import TritonServer, on_free_ports

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 16
SUBSETS = {"classes only": ("CLASS_IDS", "CLASS_PROBS"), "embedding only": ("EMBEDDING",),
           "all outputs": ()}
STAGES = ("preprocess", "classifier", "embedder", "postprocess")
DOCUMENT_LENGTHS = (512, 2048, 8192)
WINDOW_CONCURRENCY = 4  # requests in flight, documents or windows: tag_pipeline's max batch


# -- load ------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, str], float]:
    """(metric, model) -> value for Triton's per-model counters, as scraped now."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = re.match(r'^(nv_inference_request_success|nv_inference_count)\{(.*)\} (\S+)$', line)
        if match:
            model = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2))).get("model", "")
            key = (match.group(1), model)
            values[key] = values.get(key, 0.0) + float(match.group(3))
    return values


def _moved(before: dict, after: dict, metric: str, model: str) -> float:
    return after.get((metric, model), 0.0) - before.get((metric, model), 0.0)


async def drive(url: str, model: str, requests: list[dict[str, np.ndarray]], concurrency: int,
                outputs: tuple[str, ...] = (), warmup: int = 0,
                latencies: list[float] | None = None) -> tuple[float, list]:
    """Send ``requests`` (each {input name: array}) to ``model`` with ``concurrency`` in flight
    on one asyncio gRPC client, asking for ``outputs`` (all when empty); returns (wall seconds
    of the measured ones, their results in order). The first ``warmup`` are sent first and not
    measured. ``latencies``, if given, gets each measured request's seconds from send to
    answer."""
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import np_to_triton_dtype

    client = grpcaio.InferenceServerClient(url)
    slots = asyncio.Semaphore(concurrency)
    wanted = [grpcaio.InferRequestedOutput(name) for name in outputs] or None

    async def one(inputs):
        tensors = []
        for name, data in inputs.items():
            tensor = grpcaio.InferInput(name, list(data.shape), np_to_triton_dtype(data.dtype))
            tensor.set_data_from_numpy(data)
            tensors.append(tensor)
        async with slots:
            sent = time.monotonic()
            answer = await client.infer(model, tensors, outputs=wanted, client_timeout=300)
            if timed is not None:
                timed.append(time.monotonic() - sent)
            return answer

    try:
        timed = None
        await asyncio.gather(*(one(inputs) for inputs in requests[:warmup]))
        timed = latencies
        started = time.monotonic()
        results = await asyncio.gather(*(one(inputs) for inputs in requests[warmup:]))
        return time.monotonic() - started, results
    finally:
        await client.close()


def run(coroutine):
    return asyncio.run(coroutine)


# -- pruning ---------------------------------------------------------------------------------------
def _pruning(result, url: str, metrics_url: str, regime: str, count: int,
             rounds: int) -> dict:
    """Throughput and sub-requests per client request of each (model, subset) in ``regime``."""
    image = nets.synthetic_images(1, seed=5).numpy()
    requests = [{"IMAGE": image}] * count
    throughput: dict[tuple[str, str], list[float]] = {}
    per_request: dict[tuple[str, str], dict[str, float]] = {}
    for round_ in range(rounds):
        for model in ("pipeline", "pipeline_ensemble"):
            for subset, outputs in SUBSETS.items():
                run(drive(url, model, requests[:2 * CONCURRENCY], CONCURRENCY, outputs))
                before = scrape(metrics_url)
                wall, _ = run(drive(url, model, requests, CONCURRENCY, outputs))
                after = scrape(metrics_url)
                rate = count / wall
                throughput.setdefault((model, subset), []).append(rate)
                sent = {stage: _moved(before, after, "nv_inference_request_success", stage) / count
                        for stage in STAGES}
                per_request[(model, subset)] = sent
                result.rows.append({"experiment": result.name, "part": "pruning",
                                    "regime": regime, "variant": f"{model}: {subset}",
                                    "model": model, "subset": subset, "round": round_ + 1,
                                    "concurrency": CONCURRENCY, "throughput": rate,
                                    **{f"{stage}_subrequests_per_request": value
                                       for stage, value in sent.items()}})
    medians = {key: statistics.median(values) for key, values in throughput.items()}
    result.summary += [
        f"**Pruning, {regime}** (concurrency {CONCURRENCY}, {count} requests of one image per "
        f"subject and round, {rounds} interleaved rounds, median throughput in requests/s; "
        "sub-requests each stage received per client request, from Triton's "
        "`nv_inference_request_success`):", "",
        "| model | asked for | throughput | " + " | ".join(STAGES) + " |",
        "|---|---|---|" + "---|" * len(STAGES)]
    for (model, subset), rate in medians.items():
        sent = per_request[(model, subset)]
        result.summary.append(f"| `{model}` | {subset} | {rate:.1f} | "
                              + " | ".join(f"{sent[stage]:.2f}" for stage in STAGES) + " |")
    ratios = {subset: medians[("pipeline", subset)] / medians[("pipeline_ensemble", subset)]
              for subset in SUBSETS}
    result.summary += ["", "`pipeline` / `pipeline_ensemble` throughput: " + ", ".join(
        f"{subset} **{ratio:.2f}**" for subset, ratio in ratios.items()) + ".", ""]
    return {"throughput": {f"{m}: {s}": round(v, 2) for (m, s), v in medians.items()},
            "ratio": {s: round(r, 3) for s, r in ratios.items()},
            "subrequests_per_request": {f"{m}: {s}": {k: round(v, 3) for k, v in sent.items()}
                                        for (m, s), sent in per_request.items()}}


# -- windowing -------------------------------------------------------------------------------------
def _documents(length: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(length)
    return [rng.integers(0, S.TAGGER_VOCAB, (1, length), dtype=np.int64) for _ in range(count)]


def _client_windows(url: str, model: str, documents: list[np.ndarray]) -> float:
    """The client cuts each document into the orchestrator's windows, sends every window as a
    request of its own (``WINDOW_CONCURRENCY`` in flight) and stitches the answers; returns the
    wall seconds."""
    window = S.TAGGER_SEQ_LEN
    started = time.monotonic()
    cuts = []
    requests = []
    for tokens in documents:
        length = tokens.shape[1]
        starts, ends = pipelines.windows(length, window, S.WINDOW_OVERLAP)
        cuts.append((length, starts, ends, len(requests)))
        for start in starts:
            piece = np.zeros((1, window), np.int64)
            part = tokens[:, start:start + window]
            piece[:, :part.shape[1]] = part
            requests.append({"TOKENS": piece})
    _, results = run(drive(url, model, requests, WINDOW_CONCURRENCY, ("TAGS", "TAG_PROBS")))
    for length, starts, ends, first in cuts:
        tags = np.empty((1, length), np.int64)
        begin = 0
        for index, (start, end) in enumerate(zip(starts, ends)):
            tags[:, begin:end] = results[first + index].as_numpy("TAGS")[:, begin - start:end - start]
            begin = end
    return time.monotonic() - started


def _windowing(result, url: str, quick: bool) -> dict:
    rounds = 1 if quick else 5
    budget_windows = 8 if quick else 120  # windows per subject and round
    rates: dict[tuple[int, str], list[float]] = {}
    subjects = ("`tag_pipeline` cuts the windows", "client windows -> `tag_pipeline`",
                "client windows -> `tagger_tags`")
    for round_ in range(rounds):
        for length in DOCUMENT_LENGTHS:
            per_document = len(pipelines.windows(length, S.TAGGER_SEQ_LEN, S.WINDOW_OVERLAP)[0])
            documents = _documents(length, max(2, budget_windows // per_document))
            tokens = length * len(documents)
            run(drive(url, "tag_pipeline", [{"TOKENS": d} for d in documents[:2]],
                      WINDOW_CONCURRENCY))  # warm-up
            for subject in subjects:
                if subject == subjects[0]:
                    wall, _ = run(drive(url, "tag_pipeline", [{"TOKENS": d} for d in documents],
                                        WINDOW_CONCURRENCY))
                else:
                    wall = _client_windows(url, "tag_pipeline" if "pipeline" in subject
                                           else "tagger_tags", documents)
                rate = tokens / wall
                rates.setdefault((length, subject), []).append(rate)
                result.rows.append({"experiment": result.name, "part": "windowing",
                                    "variant": f"{subject}, {length} tokens", "length": length,
                                    "subject": subject, "round": round_ + 1,
                                    "documents": len(documents), "windows": per_document,
                                    "concurrency": WINDOW_CONCURRENCY, "tokens_per_s": rate})
    medians = {key: statistics.median(values) for key, values in rates.items()}
    result.summary += [
        f"**Windowing** ({S.TAGGER_SEQ_LEN}-token windows sharing at least {S.WINDOW_OVERLAP} "
        f"tokens, {WINDOW_CONCURRENCY} requests in flight — documents, or the client's windows —"
        f" about {budget_windows} windows per subject and round, {rounds} interleaved rounds; "
        "median tokens/s):", "",
        "| document | windows | " + " | ".join(subjects) + " | BLS / client windows |",
        "|---|---|" + "---|" * (len(subjects) + 1)]
    ratios = {}
    for length in DOCUMENT_LENGTHS:
        windows = len(pipelines.windows(length, S.TAGGER_SEQ_LEN, S.WINDOW_OVERLAP)[0])
        ratios[length] = medians[(length, subjects[0])] / medians[(length, subjects[1])]
        result.summary.append(f"| {length} tokens | {windows} | " + " | ".join(
            f"{medians[(length, s)]:.0f}" for s in subjects) + f" | {ratios[length]:.2f} |")
    result.summary.append("")
    return {"tokens_per_s": {f"{s}, {n}": round(v, 1) for (n, s), v in medians.items()},
            "ratio": {str(n): round(r, 3) for n, r in ratios.items()}}


# -- cascade ---------------------------------------------------------------------------------------
COMMITTED_THRESHOLD = float(S.CASCADE_THRESHOLD.default)
CASCADE_THRESHOLDS = (0.4, COMMITTED_THRESHOLD, 0.9)
CASCADE_CONCURRENCIES = (1, 16, 64)
CASCADE_SIZES = (1, 16)  # images per request
PLOT_CELL = (16, 1)      # (concurrency, images per request) of the accuracy/throughput plot


def cascade_model(threshold: float) -> str:
    """The served cascade at ``threshold``: the committed model, or a variant of it."""
    if threshold == COMMITTED_THRESHOLD:
        return S.DIGITS_CASCADE.name
    return f"{S.DIGITS_CASCADE.name}_{round(100 * threshold):03d}"


def cascade_variants(repository: Path) -> list:
    """The benchmark's cascades at the other thresholds, over ``repository``'s digits models."""
    import dataclasses

    return [dataclasses.replace(S.DIGITS_CASCADE, name=cascade_model(t), parameters={
                **S.DIGITS_CASCADE.parameters, "threshold": f"{t:g}",
                "stage_model_repositories": str(repository)})
            for t in CASCADE_THRESHOLDS if cascade_model(t) != S.DIGITS_CASCADE.name]


def _cascade_subjects() -> list[tuple[str, str]]:
    return [(S.DIGITS_SMALL.name, "`digits_small` alone"),
            (S.DIGITS_LARGE.name, "`digits_large` alone"),
            *[(cascade_model(t), f"`digits_cascade` at {t:g}") for t in CASCADE_THRESHOLDS],
            (S.DIGITS_ENSEMBLE.name, "`digits_ensemble` (both, every row)")]


def _digits_answered(model: str, answers: list) -> tuple[np.ndarray, np.ndarray | None]:
    """(digit per image, escalated per image or None) from ``model``'s answers, in order."""
    if model == S.DIGITS_ENSEMBLE.name:
        return np.concatenate([a.as_numpy(S.LARGE_PROBS.name).argmax(axis=1) for a in answers]), None
    if model in (S.DIGITS_SMALL.name, S.DIGITS_LARGE.name):
        digit = np.concatenate([a.as_numpy(S.DIGIT_PROBS.name).argmax(axis=1) for a in answers])
        return digit, np.full(len(digit), model == S.DIGITS_LARGE.name)
    return (np.concatenate([a.as_numpy(S.DIGIT.name)[:, 0] for a in answers]),
            np.concatenate([a.as_numpy(S.ESCALATED.name)[:, 0] for a in answers]))


def _cascade_requests(pixels: np.ndarray, concurrency: int, size: int, quick: bool) -> list:
    """One image per request: every reporting image once. ``size`` per request: requests
    cycling through the reporting images, enough for several rounds of ``concurrency``."""
    if size == 1:
        return [{S.DIGIT_PIXELS.name: pixels[i:i + 1]} for i in range(len(pixels))]
    count = 8 if quick else max(32, 4 * concurrency)  # quick: a smoke run, no claims
    rows = np.arange(count * size) % len(pixels)
    return [{S.DIGIT_PIXELS.name: pixels[rows[i * size:(i + 1) * size]]} for i in range(count)]


def _compute(url: str, model: str) -> tuple[int, int]:
    """(rows run, nanoseconds its batches spent in compute_infer) of ``model`` so far, from
    Triton's statistics.
    An ensemble or a BLS model's own figures are not its sub-models': (0, 0) for them."""
    import tritonclient.grpc as grpcclient

    if model not in (S.DIGITS_SMALL.name, S.DIGITS_LARGE.name):
        return 0, 0
    client = grpcclient.InferenceServerClient(url)
    try:
        (stats,) = client.get_inference_statistics(model, as_json=True)["model_stats"]
    finally:
        client.close()
    # Per batch size: a request's own statistics charge it its whole batch's time.
    batches = stats.get("batch_stats", [])
    return (sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in batches),
            sum(int(b["compute_infer"]["ns"]) for b in batches))


def _per_row(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    rows = after[0] - before[0]
    return (after[1] - before[1]) / rows / 1e6 if rows else None


def _cascade(result, url: str, repository: Path, quick: bool) -> dict:
    from modelgen import digits

    _, x_report, _, y_report = digits.split()
    if quick:
        x_report, y_report = x_report[:64], y_report[:64]
    subjects = _cascade_subjects()
    rounds = 1 if quick else 3
    cells = [(c, n) for n in CASCADE_SIZES for c in CASCADE_CONCURRENCIES]
    rates: dict[tuple[str, int, int], list[float]] = {}
    p50s: dict[tuple[str, int, int], list[float]] = {}
    p99s: dict[tuple[str, int, int], list[float]] = {}
    outcome: dict[str, tuple[float, float | None]] = {}
    large_cost: dict[tuple[int, int], list[float]] = {}
    for round_ in range(rounds):
        for concurrency, size in cells:
            requests = _cascade_requests(x_report, concurrency, size, quick)
            for model, label in subjects:
                warm = [requests[i % len(requests)]
                        for i in range(8 if quick else max(16, 2 * concurrency))]
                run(drive(url, model, warm, concurrency))
                latencies: list[float] = []
                before = _compute(url, model)
                wall, answers = run(drive(url, model, requests, concurrency,
                                          latencies=latencies))
                after = _compute(url, model)
                per_row = _per_row(before, after)
                images = sum(len(r[S.DIGIT_PIXELS.name]) for r in requests)
                rate = images / wall
                key = (label, concurrency, size)
                rates.setdefault(key, []).append(rate)
                p50s.setdefault(key, []).append(1e3 * float(np.percentile(latencies, 50)))
                p99s.setdefault(key, []).append(1e3 * float(np.percentile(latencies, 99)))
                row = {"experiment": result.name, "part": "cascade", "variant": label,
                       "model": model, "round": round_ + 1, "concurrency": concurrency,
                       "images_per_request": size, "images": images, "throughput": rate,
                       "p50_ms": p50s[key][-1], "p99_ms": p99s[key][-1],
                       "compute_ms_per_row": per_row}
                if model == S.DIGITS_LARGE.name:
                    large_cost.setdefault((concurrency, size), []).append(per_row)
                if size == 1:  # every reporting image once, in order: the served accuracy
                    digit, escalated = _digits_answered(model, answers)
                    accuracy = float((digit == y_report).mean())
                    share = None if escalated is None else float(escalated.mean())
                    outcome[label] = (accuracy, share)
                    row.update(accuracy=accuracy, escalated=share)
                result.rows.append(row)
    in_process = {m.what: m for m in digits.evaluate(repository, CASCADE_THRESHOLDS)}
    rate = {key: statistics.median(values) for key, values in rates.items()}
    p50 = {key: statistics.median(values) for key, values in p50s.items()}
    p99 = {key: statistics.median(values) for key, values in p99s.items()}
    names = {"`digits_small` alone": S.DIGITS_SMALL.name, "`digits_large` alone":
             S.DIGITS_LARGE.name, **{f"`digits_cascade` at {t:g}": f"cascade at {t:g}"
                                     for t in CASCADE_THRESHOLDS}}
    result.summary += [
        f"**Cascade** (the reporting split of scikit-learn's digits, {len(y_report)} images "
        "apart from training and from the validation split the threshold was chosen on; "
        f"committed threshold {COMMITTED_THRESHOLD:g}; {rounds} interleaved rounds, medians). "
        "Accuracy and the share of rows escalated as served, one image per request (every "
        "reporting image once), and in-process with ONNX Runtime on the same files:", "",
        "| served | accuracy | escalated | in-process accuracy, escalated |", "|---|---|---|---|"]
    for _, label in subjects:
        accuracy, escalated = outcome[label]
        local = in_process.get(names.get(label, ""))
        result.summary.append(
            f"| {label} | {100 * accuracy:.2f} % | "
            f"{'–' if escalated is None else f'{100 * escalated:.1f} %'} | "
            + (f"{100 * local.accuracy:.2f} %, {100 * local.escalated:.1f} %" if local else "–")
            + " |")
    for size in CASCADE_SIZES:
        result.summary += [
            "", f"Images/s and latency (ms, per request at the client), {size} "
            f"image{'s' if size > 1 else ''} per request"
            + (" (every reporting image once per cell)" if size == 1 else
               " (requests cycling through the reporting images, at least 32 and 4 per "
               "client)") + ":", "",
            "| served | " + " | ".join(f"c={c} images/s | p50 | p99" for c in
                                        CASCADE_CONCURRENCIES) + " |",
            "|---|" + "---|---|---|" * len(CASCADE_CONCURRENCIES)]
        for _, label in subjects:
            result.summary.append(f"| {label} | " + " | ".join(
                f"{rate[(label, c, size)]:.0f} | {p50[(label, c, size)]:.1f} | "
                f"{p99[(label, c, size)]:.1f}" for c in CASCADE_CONCURRENCIES) + " |")
    cost = {cell: statistics.median(values) for cell, values in large_cost.items()}
    result.summary += ["", "`digits_large`'s compute per row in Triton's onnxruntime backend "
                       "(the `compute_infer` time of its batches over their rows, from Triton's "
                       "statistics, one ONNX Runtime thread per instance; above c=1 two instances"
                       " share the host's cores with the server and the client), while served "
                       "alone: " + ", ".join(
                           f"c={c}, {n}/request **{value:.2f} ms**"
                           for (c, n), value in cost.items()) + ".", ""]
    committed = f"`digits_cascade` at {COMMITTED_THRESHOLD:g}"
    large, ensemble = "`digits_large` alone", "`digits_ensemble` (both, every row)"
    figures = {"throughput": {f"{label}, c={c}, {n}/request": round(v, 1)
                              for (label, c, n), v in rate.items()},
               "p50_ms": {f"{label}, c={c}, {n}/request": round(v, 2)
                          for (label, c, n), v in p50.items()},
               "p99_ms": {f"{label}, c={c}, {n}/request": round(v, 2)
                          for (label, c, n), v in p99.items()}}
    result.figures["cascade"] = ("Digits: accuracy against images/s", lambda path: _plot_cascade(
        path, subjects, outcome, rate, rounds))
    return {"accuracy": {label: round(a, 4) for label, (a, _) in outcome.items()},
            "escalated": {label: e for label, (_, e) in outcome.items()},
            **figures, "committed": committed,
            "over_ensemble_c16": round(rate[(committed, 16, 1)] / rate[(ensemble, 16, 1)], 2),
            "over_large_c16": round(rate[(committed, 16, 1)] / rate[(large, 16, 1)], 2),
            "over_ensemble_c16_16": round(rate[(committed, 16, 16)] / rate[(ensemble, 16, 16)], 2),
            "over_large_c16_16": round(rate[(committed, 16, 16)] / rate[(large, 16, 16)], 2),
            "p50_c1_over_large": round(p50[(committed, 1, 1)] / p50[(large, 1, 1)], 2),
            "large_compute_ms_per_row": {f"c={c}, {n}/request": round(v, 3)
                                         for (c, n), v in cost.items()},
            "points_below_large": round(100 * (outcome[large][0] - outcome[committed][0]), 2)}


def _plot_cascade(path: Path, subjects, outcome: dict, rate: dict, rounds: int) -> None:
    """Accuracy against images/s at ``PLOT_CELL``: the cascade's thresholds as a line, each
    model alone and the ensemble as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrency, size = PLOT_CELL
    fig, ax = plt.subplots(figsize=(8, 5))
    cascades = [(label, t) for (_, label), t in zip(subjects[2:5], CASCADE_THRESHOLDS)]
    xs = [rate[(label, concurrency, size)] for label, _ in cascades]
    ys = [100 * outcome[label][0] for label, _ in cascades]
    ax.plot(xs, ys, marker="o", color="tab:blue", label="digits_cascade at a threshold")
    for index, ((label, threshold), x, y) in enumerate(zip(cascades, xs, ys)):
        share = outcome[label][1]
        committed = " (committed)" if threshold == COMMITTED_THRESHOLD else ""
        ax.annotate(f"{threshold:g}{committed}\n{100 * share:.1f} % escalated", (x, y),
                    textcoords="offset points", xytext=(-20, -52 if index % 2 else -28),
                    fontsize=8)
    for (_, label), marker in zip((subjects[0], subjects[1], subjects[5]), ("s", "^", "D")):
        x, y = rate[(label, concurrency, size)], 100 * outcome[label][0]
        ax.scatter([x], [y], marker=marker, s=60, label=label.replace("`", ""), zorder=3)
    ax.set_xscale("log")
    ax.margins(x=0.1, y=0.25)
    ax.set_xlabel(f"images/s (concurrency {concurrency}, {size} image per request; log scale)")
    ax.set_ylabel("accuracy on the reporting split (%)")
    ax.set_title(f"Digits: accuracy against throughput ({rounds} rounds, medians)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cascade_targets(cascade: dict) -> list[str]:
    return [
        target_line("cascade / `digits_ensemble` images/s, c=16, one image per request",
                    cascade["over_ensemble_c16"], 2.5, "higher"),
        target_line("cascade / `digits_large` alone images/s, c=16, one image per request",
                    cascade["over_large_c16"], 2.0, "higher"),
        target_line("cascade accuracy minus `digits_large` alone, reporting split, points "
                    "(served)", 0.0 - cascade["points_below_large"], -0.3, "higher"),
        target_line("share of rows escalated at the committed threshold",
                    cascade["escalated"][cascade["committed"]], 0.15, "lower"),
        target_line("cascade p50 at c=1 / `digits_large` alone", cascade["p50_c1_over_large"],
                    1.0, "lower")]


# -- the experiment --------------------------------------------------------------------------------
def control_flow(ctx: Context) -> Result:
    result = Result("control_flow", "What an ensemble cannot do: requested outputs, long "
                    "documents, a cascade")
    quick = ctx.quick
    # Each subject a few seconds per round: this host's speed moves by tens of per cent within
    # minutes, so rounds are many and short, interleaved.
    count, rounds = (16, 1) if quick else (480, 5)
    if os.environ.get("CONTROL_FLOW_PARTS") == "cascade":  # the cascade alone (module docstring)
        cascade = _cascade(result, ctx.server.grpc_url, ctx.repository, quick)
        result.data.update(cascade=cascade)
        result.summary += ["**Targets**", "", *_cascade_targets(cascade)]
        return result
    committed = _pruning(result, ctx.server.grpc_url, ctx.server.metrics_url,
                         "committed CNNs", count // 2 if not quick else count, rounds)
    with tempfile.TemporaryDirectory(prefix="bench-fast-") as tmp:
        repository = overhead.fast_repository(Path(tmp) / "repository", ctx.repository)
        log = ROOT / ".triton" / f"bench-control-flow-fast-{time.strftime('%Y%m%d-%H%M%S')}.log"
        with TritonServer(on_free_ports(repository, log)) as fast:
            faster = _pruning(result, fast.grpc_url, fast.metrics_url, "fast sub-models",
                              count * 2 if not quick else count, rounds)
    windowing = _windowing(result, ctx.server.grpc_url, quick)
    cascade = _cascade(result, ctx.server.grpc_url, ctx.repository, quick)
    result.data.update(pruning={"committed": committed, "fast": faster}, windowing=windowing,
                       cascade=cascade)
    embedder = committed["subrequests_per_request"]["pipeline: classes only"]["embedder"]
    fast_embedder = faster["subrequests_per_request"]["pipeline: classes only"]["embedder"]
    classes_only = committed["ratio"]["classes only"] - committed["ratio"]["all outputs"]
    result.summary += [
        "**Targets**", "",
        target_line("\"classes only\": embedder sub-requests per client request "
                    f"(committed CNNs; fast sub-models: {fast_embedder:.2f})",
                    embedder, 0.0, "lower"),
        target_line("\"classes only\" `pipeline` / ensemble throughput, committed "
                    "CNNs, minus the same for \"all outputs\"", classes_only, 0.0, "higher"),
        target_line("8 192-token documents: tokens/s, BLS / client-side windows",
                    windowing["ratio"][str(8192)], 1.0, "higher"),
        *_cascade_targets(cascade)]
    result.plot = {"kind": "bars", "title": "Throughput by outputs asked for (concurrency "
                   f"{CONCURRENCY})", "filter": {"part": "pruning"}, "value": "throughput",
                   "label": ["regime", "variant"], "xlabel": "requests/s"}
    return result
