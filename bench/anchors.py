"""What the runtime is measured against, the same work done other ways:

* ``pipeline_minimal`` (``bench/models/minimal.py``), the plainest per-batch BLS: the anchor of
  the overhead and orchestration experiments. It is not part of the production repository;
  ``write`` renders it into a benchmark or test repository with ``pipeline``'s contract and
  batching;
* ``InProcess``: the pipeline's ONNX models in this process, no server at all (the limit of this
  machine);
* ``client_pipeline``: the client calling the sub-models itself.

The last two are load generators written in the project, for what perf_analyzer cannot do; both
are bounded in count and time and report the same numbers as perf_analyzer's rows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from bench import perf, profile
from bls_models import pipelines
from bls_models import spec as S
from modelgen import configs, export, nets

MODELS = Path(__file__).resolve().parent / "models"
# ``profile.drive``'s warm-up and tail on smoke settings: seconds of waiting, no claims.
QUICK_DRIVE = {"warmup": 0.5, "tail": 1.0}
MINIMAL = MODELS / "minimal.py"


def write(target: Path, repository: Path) -> None:
    """The anchor as ``pipeline_minimal`` in ``target``, with ``pipeline``'s contract, batching
    and parameters, over the stage models of ``repository``."""
    spec = dataclasses.replace(S.PIPELINE, name="pipeline_minimal", parameters={
        **S.PIPELINE.parameters, "stage_model_repositories": str(repository)})
    (target / spec.name / "1").mkdir(parents=True)
    (target / spec.name / "config.pbtxt").write_text(configs.render(spec))
    (target / spec.name / "1" / "model.py").write_text(MINIMAL.read_text())


def write_minimal(target: Path, pipeline_config: Path) -> None:
    """The anchor as ``pipeline_minimal`` beside a repository's ``pipeline``, with that
    ``pipeline``'s config (its stage models and batching) under its own name."""
    (target / "pipeline_minimal" / "1").mkdir(parents=True)
    (target / "pipeline_minimal" / "config.pbtxt").write_text(
        pipeline_config.read_text().replace('name: "pipeline"', 'name: "pipeline_minimal"', 1))
    (target / "pipeline_minimal" / "1" / "model.py").write_text(MINIMAL.read_text())


class InProcess:
    """preprocess -> classifier + embedder -> top-5, with ONNX Runtime sessions in this process.

    The two branches run concurrently, as the orchestrator runs them (ONNX Runtime releases the
    GIL): the embedder on a pool thread while the calling thread runs the classifier."""

    def __init__(self, repository: Path, threads_per_session: int = 1,
                 models: tuple[S.ModelSpec, ...] = (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER,
                                                    S.TAGGER)) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads_per_session
        options.inter_op_num_threads = 1
        self.sessions = {m.name: ort.InferenceSession(str(export.onnx_path(repository, m)), options,
                                                      providers=["CPUExecutionProvider"])
                         for m in models}
        self.branches = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="branch")

    def pipeline(self, image: np.ndarray) -> dict[str, np.ndarray]:
        (pixels,) = self.sessions["preprocess"].run(None, {"IMAGE": image})
        embedded = self.branches.submit(self.sessions["embedder"].run, None, {"PIXELS": pixels})
        (logits,) = self.sessions["classifier"].run(None, {"PIXELS": pixels})
        (embedding,) = embedded.result()
        ids, probs = pipelines.softmax_top_k(logits)
        return {"CLASS_IDS": ids, "CLASS_PROBS": probs, "EMBEDDING": embedding}

    def tagger(self, tokens: np.ndarray) -> np.ndarray:
        return self.sessions["tagger"].run(None, {"TOKENS": tokens})[0]

    def measure(self, work, concurrency: int, seconds: float) -> perf.Point:
        """``concurrency`` threads calling ``work()`` back to back for ``seconds``."""
        latencies: list[float] = []
        lock = threading.Lock()
        stop = time.monotonic() + seconds

        def worker():
            mine = []
            while time.monotonic() < stop:
                started = time.monotonic()
                work()
                mine.append(time.monotonic() - started)
            with lock:
                latencies.extend(mine)

        work()  # warm-up
        started = time.monotonic()
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.calls = len(latencies) + 1  # with the warm-up, for CPU accounting
        return perf.point(concurrency, latencies, time.monotonic() - started)

    def cpu_per_request(self, work, concurrency: int, seconds: float) -> tuple[perf.Point, float]:
        """``measure``, and the CPU milliseconds this process used per call meanwhile."""
        before = time.process_time()
        measured = self.measure(work, concurrency, seconds)
        return measured, 1000 * (time.process_time() - before) / self.calls


async def client_pipeline(url: str, concurrency: int, count: int) -> perf.Point:
    """The client orchestrates, three calls per image: preprocess, then classifier and embedder
    concurrently, top-5 in the client (gRPC)."""
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    image = nets.synthetic_images(1, seed=5).numpy()
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    def tensor(name, data, dtype):
        t = grpcaio.InferInput(name, list(data.shape), dtype)
        t.set_data_from_numpy(data)
        return [t]

    async def one():
        async with slots:
            started = time.monotonic()
            pixels = (await client.infer("preprocess", tensor("IMAGE", image, "UINT8"))).as_numpy("PIXELS")
            classified, embedded = await asyncio.gather(
                client.infer("classifier", tensor("PIXELS", pixels, "FP32")),
                client.infer("embedder", tensor("PIXELS", pixels, "FP32")))
            pipelines.softmax_top_k(classified.as_numpy("LOGITS"))
            embedded.as_numpy("EMBEDDING")
            latencies.append(time.monotonic() - started)

    try:
        await asyncio.gather(*(one() for _ in range(min(count, 2 * concurrency))))  # warm-up
        latencies.clear()
        started = time.monotonic()
        await asyncio.gather(*(one() for _ in range(count)))
        return perf.point(concurrency, latencies, time.monotonic() - started)
    finally:
        await client.close()


def side_by_side(server, models: dict[str, str], rounds: int, levels=(16, 64),
                 seconds: float = 8.0, quick: bool = False) -> dict[str, dict[str, list[float]]]:
    """The figures the anchor targets are about, for each of ``models`` (key -> model), in
    ``rounds`` interleaved rounds (the order reversed every other round: this host's speed moves
    by tens of percent within minutes): p50 at concurrency 1 (µs, perf_analyzer), and at each of
    ``levels`` the throughput (req/s) and, at the first, the model's stubs' CPU per request (ms).
    Returns key -> figure -> one value per round. ``quick``: smoke settings (no claims)."""
    out = {key: {"p50_c1_us": [], **{f"rps_c{c}": [] for c in levels}, "stub_cpu_ms": []}
           for key in models}
    if not quick:  # unmeasured first runs (ONNX Runtime's arenas, threads); a smoke run skips them
        for model in models.values():
            profile.drive(server, model, levels[-1], 5.0, **QUICK_DRIVE)
    for index in range(rounds):
        order = list(models.items()) if index % 2 == 0 else list(models.items())[::-1]
        for key, model in order:
            p50 = perf.p50_at_1(server, model, quick)
            if p50 is not None:
                out[key]["p50_c1_us"].append(p50)
            for level in levels:
                load = profile.drive(server, model, level, seconds, **QUICK_DRIVE if quick
                                     else {"warmup": 3.0})
                out[key][f"rps_c{level}"].append(load.requests / load.seconds)
                if level == levels[0]:
                    out[key]["stub_cpu_ms"].append(
                        load.cpu_ms_per_request().get(f"{model} stubs", 0.0))
    return out


def paired(figures: dict, key: str, base: str, figure: str, difference: bool = False
           ) -> list[float]:
    """Round by round, ``key``'s figure over (or minus) ``base``'s."""
    return [a - b if difference else a / b
            for a, b in zip(figures[key][figure], figures[base][figure]) if b]


def add_rounds(result, figures: dict) -> None:
    """One CSV row per anchor figure and round (``figures``: key -> figure -> per-round values)
    in ``result``, and the rounds themselves in its JSON data."""
    for key, values in figures.items():
        for figure, per_round in values.items():
            for index, value in enumerate(per_round):
                result.rows.append({"experiment": result.name, "variant": f"anchor: {key}",
                                    "scenario": "targets", "figure": figure,
                                    "round": index + 1, "value": round(value, 3)})
    result.data["anchor_rounds"] = figures


def summary(values: list[float], digits: int = 2) -> str:
    """``median (min–max)`` of ``values``."""
    if not values:
        return "not measured"
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–"
            f"{max(values):.{digits}f})")
