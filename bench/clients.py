"""Load generators written in the project, for what perf_analyzer cannot do: the same pipeline
in-process (the limit of this machine), the pipeline driven by the client (sub-models called
directly), one model alone one request at a time. All are bounded in count and time and report
the same numbers as perf_analyzer's rows."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path

import numpy as np

from bench.perf import Point
from bls_models import pipelines
from bls_models import spec as S
from modelgen import export, nets

# The end-to-end budget these load generators give each request (the `timeout` parameter, µs):
# 1 000 requests in flight on 2 cores wait far longer than the orchestrator's 10 s default
# deadline, which would otherwise (correctly) answer the late ones with UNAVAILABLE.
BUDGET_US = 120_000_000


def point(concurrency: int, latencies: list[float], wall: float) -> Point:
    ms = np.array(latencies) * 1e3 if latencies else np.array([np.nan])
    return Point(concurrency=concurrency, throughput=len(latencies) / wall if wall else 0.0,
                 p50_ms=float(np.percentile(ms, 50)), p90_ms=float(np.percentile(ms, 90)),
                 p95_ms=float(np.percentile(ms, 95)), p99_ms=float(np.percentile(ms, 99)),
                 server_queue_ms=0.0, server_compute_ms=0.0, client_send_recv_ms=0.0)


# -- in-process onnxruntime: the same work with no server at all -------------------------------------
class InProcess:
    """preprocess -> classifier + embedder -> top-5, with ONNX Runtime sessions in this process.

    The two branches run concurrently, as the orchestrator runs them (ONNX Runtime releases the
    GIL): the embedder on a pool thread while the calling thread runs the classifier."""

    def __init__(self, repository: Path, threads_per_session: int = 1,
                 models: tuple[S.ModelSpec, ...] = (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER,
                                                    S.TAGGER, S.TAGGER_TAGS)) -> None:
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

    def tagger_tags(self, tokens: np.ndarray) -> list[np.ndarray]:
        return self.sessions["tagger_tags"].run(None, {"TOKENS": tokens})

    def measure(self, work, concurrency: int, seconds: float) -> Point:
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
        return point(concurrency, latencies, time.monotonic() - started)

    def cpu_per_request(self, work, concurrency: int, seconds: float) -> tuple[Point, float]:
        """``measure``, and the CPU milliseconds this process used per call meanwhile."""
        before = time.process_time()
        measured = self.measure(work, concurrency, seconds)
        return measured, 1000 * (time.process_time() - before) / self.calls


# -- one model alone, one request at a time ---------------------------------------------------------
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
        return point(1, latencies, time.monotonic() - started)
    finally:
        client.close()


# -- the client orchestrates: three calls per image ------------------------------------------------
async def client_pipeline(url: str, concurrency: int, count: int) -> Point:
    """preprocess, then classifier and embedder concurrently, top-5 in the client (gRPC)."""
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
        return point(concurrency, latencies, time.monotonic() - started)
    finally:
        await client.close()
