"""Answers client requests: exactly once each, whatever raises.

A request is answered by whoever gets there first — its group with outputs or an error, ``execute``
or the clock at its deadline, shutdown — and ``answer`` claims it under one lock, so later calls
do nothing. While ``execute`` waits for its batch (``Job.returning``) the response goes back in
``execute``'s list, one message for the batch; once ``execute`` has stopped waiting (``detach``)
it goes through the request's response sender. A response that cannot be built becomes INTERNAL
(the log has the details); only if not even that can be built, or a send fails (r24.10 closes a
sender before its response crosses, so no retry), is the request counted ``SEND_FAILED``.
"""

from __future__ import annotations

import threading
import time
import traceback

import numpy as np

from bls_models.errors import PipelineError, internal_error
from bls_models.metrics import REQUEST_CODES


class Batch:
    """The requests one ``execute`` waits for: ``done`` once none is left (set under the
    answers' lock; only ``execute``'s thread waits, on a lock released once: cheaper than a
    ``threading.Event``, which a batch would otherwise make)."""

    __slots__ = ("waiting", "done", "_latch")

    def __init__(self) -> None:
        self.waiting = 0
        self.done = False
        self._latch = threading.Lock()
        self._latch.acquire()

    def set(self) -> None:
        if not self.done:
            self.done = True
            self._latch.release()

    def unset(self) -> None:
        if self.done:
            self.done = False
            self._latch.acquire()

    def wait(self, timeout: float) -> bool:
        """Whether the batch is done, waiting up to ``timeout`` seconds for it."""
        if self.done:
            return True
        if self._latch.acquire(timeout=max(0.0, timeout)):
            self._latch.release()
        return self.done


class Job:
    """One client request, from ``execute`` until its answer."""

    __slots__ = ("request", "request_id", "deadline", "received", "inputs", "rows", "outputs",
                 "answered", "returning", "held", "batch", "sender", "sender_lock", "slot",
                 "queued", "counted", "timer", "group")

    def __init__(self, request, deadline, received: float, batch: Batch) -> None:
        self.request = request    # only while execute runs: its sender is taken from it
        self.request_id = ""
        self.deadline = deadline
        self.received = received  # arrival in execute (time.monotonic): deadlines count from it
        self.inputs: dict[str, np.ndarray] = {}
        self.rows = 0
        self.outputs: list[str] = []
        self.answered = False
        self.returning = True     # answered through execute's list (while execute waits)
        self.held = None          # that answer (backend.Held)
        self.batch = batch
        self.sender = None        # taken when execute stops waiting for it
        self.sender_lock = None   # is_cancelled never meets a send on the same sender
        self.slot = False         # holds one of max_inflight_requests
        self.queued = False       # waits for one
        self.counted: set[str] = set()
        self.timer = None         # the clock's deadline for it, once execute stopped waiting
        self.group = None

    def first(self, event: str) -> bool:
        """Whether ``event`` (a deadline, a cancellation) happens to it for the first time."""
        first = event not in self.counted
        self.counted.add(event)
        return first


class Answers:
    def __init__(self, backend, metrics, output_dtypes: dict, model: str, log,
                 on_answered) -> None:
        self.backend, self.metrics, self.log, self.model = backend, metrics, log, model
        self.output_dtypes = output_dtypes
        self.on_answered = on_answered  # answered jobs let go of their slots or queue places
        self._lock = threading.Lock()
        self.pending: set[Job] = set()   # admitted, not answered: what shutdown answers
        key = metrics.key
        metrics.watch("bls_inflight_requests", self.pending.__len__)
        self._latency = key("bls_request_latency_seconds")
        self._codes = {code: key("bls_requests_total", code=code) for code in REQUEST_CODES}

    def received(self, batch: Batch, jobs) -> None:
        """``execute`` has read its batch: ``jobs`` (those not answered at once) are pending,
        and ``batch.done`` now says whether any answer is owed (answers given while reading
        counted down as they came)."""
        with self._lock:
            self.pending.update(jobs)
            if batch.waiting > 0:
                batch.unset()
            else:
                batch.set()

    def answer(self, job: Job, outputs: dict | None = None,
               error: PipelineError | None = None) -> bool:
        """Answer ``job`` with ``outputs`` or ``error`` unless it was answered already; returns
        whether this call answered it. Never raises."""
        return self.answer_each([job], [outputs], error) == 1

    def answer_each(self, jobs: list[Job], outputs: list | None = None,
                    error: PipelineError | None = None) -> int:
        """Answer each of ``jobs`` not answered yet with its ``outputs`` (in order), or all with
        ``error``; returns how many this call answered. Never raises."""
        claimed = []
        with self._lock:
            for index, job in enumerate(jobs):
                if not job.answered:
                    job.answered = True
                    claimed.append((job, job.returning,
                                    None if outputs is None else outputs[index]))
                    self.pending.discard(job)
        if not claimed:
            return 0
        now = time.monotonic()
        increments: dict = {}
        observations, finished = [], []
        try:
            for job, returning, rows in claimed:
                key = self._codes[self._give(job, returning, rows, error)]
                increments[key] = increments.get(key, 0) + 1
                observations.append((self._latency, now - job.received))
                job.inputs = {}
                if returning:
                    finished.append(job.batch)
        finally:
            try:
                self.metrics.record(increments=increments.items(), observations=observations)
                self.on_answered([job for job, *_ in claimed])
            finally:  # last: execute's thread, once woken, waits for nothing of this one's
                with self._lock:
                    for batch in finished:
                        batch.waiting -= 1
                        if batch.waiting <= 0:
                            batch.set()
        return len(claimed)

    def _give(self, job: Job, returning: bool, outputs, error) -> str:
        """Build ``job``'s response and hand it over (into ``execute``'s list, or through its
        sender); returns its code. Never raises."""
        code, held = "SEND_FAILED", None
        try:
            code, held = self._build(job, outputs, error)
            if held is None:
                code = "SEND_FAILED"
            elif returning:
                job.held, held = held, None
            else:
                with job.sender_lock:
                    try:
                        self.backend.send(job.sender, held)
                    except Exception:  # noqa: BLE001 - the sender is closed now (r24.10): no retry
                        self.log(f"could not send the response of '{job.request_id}':\n"
                                 f"{traceback.format_exc()}", error=True)
                        code = "SEND_FAILED"
                    held = None
        except Exception:  # noqa: BLE001 - nothing here may take the slot with it
            self.log(f"answering '{job.request_id}' failed:\n{traceback.format_exc()}",
                     error=True)
            code = "SEND_FAILED"
        finally:
            try:
                self.backend.release(held)
            except Exception:  # noqa: BLE001 - logged; the answer is counted all the same
                self.log(f"releasing the response of '{job.request_id}' failed:\n"
                         f"{traceback.format_exc()}", error=True)
        return code

    def detach(self, jobs) -> list[Job]:
        """``execute`` stops waiting for ``jobs``: those not answered yet that have a response
        sender will be answered through it; returns them. A job already claimed stays in
        ``execute``'s list (its answer is being built: ``batch.done`` says when)."""
        detached = []
        with self._lock:
            for job in jobs:
                if not job.answered and job.returning and job.sender is not None:
                    job.returning = False
                    job.sender_lock = threading.Lock()
                    job.batch.waiting -= 1
                    detached.append(job)
            for job in jobs:
                if job.batch.waiting <= 0:
                    job.batch.set()
        return detached

    def cancelled(self, job: Job) -> bool:
        """Whether the client cancelled a detached job (a round trip to the server; never
        after its answer was sent). A check that fails counts as not cancelled."""
        with job.sender_lock:
            if job.answered:
                return False
            try:
                return self.backend.is_cancelled(job.sender)
            except Exception:  # noqa: BLE001 - the request goes on; its answer says how it ends
                self.log(f"is_cancelled() failed for '{job.request_id}':\n"
                         f"{traceback.format_exc()}", error=True)
                return False

    def answer_all(self, error: PipelineError) -> int:
        """Answer every pending request with ``error`` (shutdown); returns how many."""
        with self._lock:
            jobs = list(self.pending)
        return self.answer_each(jobs, error=error)

    # -- responses ----------------------------------------------------------------------------
    def _build(self, job: Job, outputs: dict | None, error: PipelineError | None):
        """(code, held response): the outputs, else the error, else INTERNAL when the response
        could not be built; (SEND_FAILED, None) if not even that can be built."""
        if error is None:
            try:
                return "SUCCESS", self._outputs(job, outputs)
            except Exception:  # noqa: BLE001 - the orchestrator's own failure: the client hears INTERNAL
                self.log(f"the response of '{job.request_id}' could not be built:\n"
                         f"{traceback.format_exc()}", error=True)
                error = internal_error(self.model)
        for answer in (error, internal_error(self.model)):  # the error, else a plain INTERNAL
            try:
                return answer.code.value, self.backend.error_response(answer.message,
                                                                      answer.code.value)
            except Exception:  # noqa: BLE001 - logged; the plainer answer is tried next
                self.log(f"an error response for '{job.request_id}' could not be built:\n"
                         f"{traceback.format_exc()}", error=True)
        return "SEND_FAILED", None

    def _outputs(self, job: Job, outputs: dict | None):
        arrays = []
        for name in job.outputs:
            value = None if outputs is None else outputs.get(name)
            if value is None:
                raise ValueError(f"the pipeline returned no output '{name}'")
            array = np.ascontiguousarray(value, self.output_dtypes[name])
            if array.ndim == 0 or array.shape[0] != job.rows:
                raise ValueError(f"output '{name}' has shape {array.shape}, not {job.rows} rows "
                                 "like the request")
            arrays.append((name, array))
        return self.backend.response(arrays)
