"""Closed-loop load against a tritonserver, accounting for every request: the clients the live
tests and the benchmarks both drive servers with (one asyncio gRPC connection, many clients).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Answer:
    """One request of a closed-loop run, as the client saw it."""

    started: float            # time.monotonic()
    finished: float
    sent_id: str
    answered_id: str | None   # the id on the response; None for an error
    code: str | None          # gRPC status of an error ("StatusCode.UNAVAILABLE"); None if answered
    message: str = ""

    @property
    def seconds(self) -> float:
        return self.finished - self.started


async def closed_loop(url: str, model: str, clients: int, data: np.ndarray,
                      stop: threading.Event, name: str = "IMAGE", dtype: str = "UINT8",
                      timeout_us: int | None = None, retry_pause: float = 0.01,
                      answers: list[Answer] | None = None,
                      client_timeout: float = 300.0) -> list[Answer]:
    """``clients`` concurrent clients over one asyncio gRPC connection, each sending its next
    request as soon as the last one is answered (``retry_pause`` after an error, so a refused
    client does not spin), until ``stop`` is set. Every request is appended to ``answers`` as it
    completes (so another thread can watch the run), which is returned. ``timeout_us`` is
    Triton's timeout for the request, ``client_timeout`` the client's gRPC deadline (seconds;
    ``StatusCode.DEADLINE_EXCEEDED`` past it)."""
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException

    client = grpcaio.InferenceServerClient(url)
    answers = [] if answers is None else answers

    async def worker(index: int) -> None:
        sequence = 0
        while not stop.is_set():
            inputs = [grpcaio.InferInput(name, list(data.shape), dtype)]
            inputs[0].set_data_from_numpy(data)
            sent_id, started = f"{model}-{index}-{sequence}", time.monotonic()
            sequence += 1
            try:
                result = await client.infer(model, inputs, request_id=sent_id,
                                            timeout=timeout_us, client_timeout=client_timeout)
                answers.append(Answer(started, time.monotonic(), sent_id,
                                      result.get_response().id, None))
            except InferenceServerException as error:
                answers.append(Answer(started, time.monotonic(), sent_id, None,
                                      str(error.status()), error.message() or ""))
                await asyncio.sleep(retry_pause)

    try:
        await asyncio.gather(*(worker(i) for i in range(clients)))
    finally:
        await client.close()
    return answers


def closed_loop_for(url: str, model: str, clients: int, data: np.ndarray, seconds: float,
                    **kw) -> list[Answer]:
    """``closed_loop`` for ``seconds`` (then every request in flight is still awaited)."""
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        return asyncio.run(closed_loop(url, model, clients, data, stop, **kw))
    finally:
        timer.cancel()
