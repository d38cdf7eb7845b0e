"""Answers client requests: exactly once each, with backpressure and a count of those pending.

Part of the orchestrator runtime (``triton_runtime`` wires it): every ``pb_utils`` call here holds
the runtime's lock, and the response sender is dropped under it once used, so a request can be
answered only once whatever races to answer it (its pipeline, shutdown's cancellation).
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from bls_models.deadline import Deadline
from bls_models.errors import PipelineError


@dataclass
class Job:
    """One client request, from ``execute`` until its response is sent."""

    inputs: dict[str, np.ndarray]
    outputs: list[str]
    deadline: Deadline
    request_id: str        # forwarded to every sub-request
    sender: object         # pb_utils InferenceResponseSender; None once answered
    received: float = field(default_factory=time.monotonic)
    # Stage outputs kept on the GPU for this request (subrequests.DeviceTensor); released when
    # it is answered.
    device_tensors: list = field(default_factory=list)
    # Per-request events already counted: concurrent branches both see a cancellation or a
    # passed deadline, and each counter counts once per request and event.
    counted: set[str] = field(default_factory=set)
    # Whether the client cancelled, as last asked (None: ask; subrequests.SubRequests.cancelled).
    # False at first for a request execute took at once: the scheduler had just checked it.
    cancelled: bool | None = None
    cancel_answer_expires: bool = False  # a reset at the end of this loop turn is scheduled

    def first(self, event: str) -> bool:
        """Whether ``event`` happens to this request for the first time (under the lock)."""
        first = event not in self.counted
        self.counted.add(event)
        return first


class Responder:
    """Admits requests (at most ``max_inflight`` unanswered: beyond that ``admit`` waits, so
    further requests stay in Triton's bounded, timeout-aware queue) and answers each once."""

    def __init__(self, pb_utils, lock: threading.RLock, metrics, output_dtypes: dict,
                 max_inflight: int, log) -> None:
        self.pb, self.lock, self.metrics, self.log = pb_utils, lock, metrics, log
        self.output_dtypes = output_dtypes
        self.slots = threading.BoundedSemaphore(max_inflight)
        self.pending = 0  # admitted and not yet answered (under the lock)

    def admit(self) -> bool:
        """Wait for a slot (on execute's thread, outside the lock); whether it had to wait."""
        if self.slots.acquire(blocking=False):
            return False
        self.slots.acquire()
        return True

    def started(self) -> None:
        """An admitted request became a job: it is pending until ``send`` (under the lock)."""
        self.pending += 1

    def refuse(self, sender, message: str) -> None:
        """Answer a request that never became a job (under the lock) and free its slot."""
        pb = self.pb
        sender.send(pb.InferenceResponse(error=pb.TritonError(message, pb.TritonError.INVALID_ARG)),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.slots.release()

    def send(self, job: Job, outputs: dict[str, np.ndarray] | None,
             error: PipelineError | None) -> None:
        """Answer ``job`` with ``outputs`` or ``error``, unless it was answered already."""
        pb = self.pb
        code = "SUCCESS"
        with self.lock:
            sender, job.sender = job.sender, None
            for device in job.device_tensors:  # answered (or failed): its GPU buffers can go
                device.release()
            job.device_tensors.clear()
            if sender is None:  # never answer twice
                return
            self.pending -= 1
            try:
                if error is None:
                    tensors = [pb.Tensor(n, np.ascontiguousarray(outputs[n], self.output_dtypes[n]))
                               for n in job.outputs]
                    response = pb.InferenceResponse(output_tensors=tensors)
                else:
                    code = error.code.value
                    response = pb.InferenceResponse(
                        error=pb.TritonError(error.message, getattr(pb.TritonError, code)))
                sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # noqa: BLE001 - e.g. the client is gone; log, never retry
                self.log(f"could not send the response of '{job.request_id}':\n"
                         f"{traceback.format_exc()}", error=True)
                code = "SEND_FAILED"
            finally:
                del sender
                self.metrics.increment("bls_requests_total", code=code)
                self.metrics.observe("bls_request_latency_seconds", time.monotonic() - job.received)
                self.metrics.increment("bls_inflight_requests", -1)
        self.slots.release()

    def drain(self, seconds: float) -> int:
        """Wait up to ``seconds`` for pending requests to be answered; returns how many remain."""
        deadline = time.monotonic() + seconds
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.pending
