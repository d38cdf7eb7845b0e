"""Answers client requests: exactly once each, whatever raises, with backpressure and a record of
those pending.

Part of the orchestrator runtime (``triton_runtime`` wires it). What it holds to:

* **One final response per request.** ``answer`` takes the request's response sender away
  under this object's lock, so whoever races to answer (the pipeline, its deadline, shutdown)
  answers once; later calls do nothing. In python_backend r24.10 a sender closes *before* its
  response crosses to the server (``response_sender.cc``, ``UpdateStateAndCounters``), so a send
  that raises cannot be retried: it is logged and counted ``SEND_FAILED``.
* **A response that cannot be built becomes INTERNAL.** Missing or malformed outputs, a failing
  ``pb_utils.Tensor`` or ``InferenceResponse``: the client gets INTERNAL ("see the server log"),
  the log gets the details. Only if not even that response can be built is the request lost
  (``SEND_FAILED``).
* **Answers returned from execute.** A request without a response sender
  (``get_response_sender()`` raised in ``execute``), and a request answered while ``execute``
  waits for its batch (``return_within_ms``, ``batch_gather``), is answered through
  ``execute``'s return value, which r24.10 accepts next to senders (``None``
  for the others: ``python_be.cc``, ``ProcessRequests``). The stub sends a batch's returned
  responses to the server in one message, where each ``send`` is a round trip of its own
  (bench/results/pb_calls.md).
* **Admission with deadlines.** At most ``max_inflight`` requests run at once; up to
  ``max_queued`` more wait here for a slot, in arrival order, each answered UNAVAILABLE when
  its deadline passes (``enter``, ``leave``: the event loop's side). Beyond those, ``admit``
  (``execute``'s thread) waits, and further requests stay in Triton's bounded queue of this
  model — but only until the earliest deadline of the requests it holds: a request whose
  deadline passes while ``execute`` waits is answered then. Waiting here rather than in
  Triton's queue keeps deadlines on time under overload: while every instance is busy, Triton
  checks its queue's timeouts only every 500 ms (core r24.10 ``dynamic_batch_scheduler.cc``,
  ``WaitForPayloadSlotAvailable``), and tells a model nothing of the time a request spent
  there.
* **Nothing stays behind.** The room an admitted request takes is given back when it is
  answered, in ``finally``; ``pending`` holds the admitted requests not yet answered, so
  shutdown can answer every one of them (``answer_all``).

The lock here guards only this object's state; no pb_utils call is made under it. Backend
objects (tensors, responses) are created and destroyed under the runtime's pb_utils lock, and
``send`` — a round trip to the server — is called with no lock held.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bls_models.deadline import Deadline
from bls_models.errors import Code, PipelineError, SlotWaitExpired, internal_error
from bls_models.metrics import ADMISSION


@dataclass(eq=False)
class Job:
    """One client request, from ``execute`` until its response is sent."""

    deadline: Deadline
    received: float        # when execute got it (time.monotonic): its deadline counts from here
    sender: object = None  # pb_utils InferenceResponseSender; None once answered, or if none
    request_id: str = ""   # forwarded to every sub-request
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    rows: int = 0          # its batch size: every output must have as many rows
    outputs: list[str] = field(default_factory=list)
    # Why it cannot run (set in execute: it is answered at once), or None.
    failure: PipelineError | None = None
    admitted: bool = False   # holds room in the orchestrator (given back when answered)
    started: bool = False    # handed to the event loop, which then owns its sender
    answered: bool = False
    running: bool = False    # holds one of the max_inflight slots (event loop only)
    expiry: object = None    # while it waits for a slot: the timer that answers its deadline
    # Set when it is answered, while execute waits for its batch's answers.
    done: threading.Event | None = None
    # Answered through execute's return value, not its sender: a request whose sender could
    # not be had, and one answered while execute waits (``Responder.to_senders`` turns the
    # others back to their senders when it stops). ``returned`` is the response.
    by_return: bool = False
    returned: object = None
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
    # A group (``group``): the member jobs whose stacked rows it runs, and how a member leaves
    # the group early (a cancelled one is answered at once). None for a client request.
    members: list | None = None
    drop: object = None
    # The first failure of one of its sub-requests that no item causes (a stage failing as a
    # whole, or the orchestrator's own code in a stage): a failed group is then not re-run
    # member by member (that would hit the stage again), and its members hear this failure.
    stage_failure: PipelineError | None = None

    def first(self, event: str) -> bool:
        """Whether ``event`` happens to this request for the first time (event loop only)."""
        first = event not in self.counted
        self.counted.add(event)
        return first

    def live(self) -> list["Job"]:
        """The client requests this job still answers for: itself, or a group's members not
        answered yet."""
        if self.members is None:
            return [] if self.answered else [self]
        return [member for member in self.members if not member.answered]


def group(members: list[Job]) -> Job:
    """One job over the stacked rows of ``members`` (started together, with the same deadline,
    input shapes and dtypes, and requested outputs): the run function runs once for all of
    them, and each member is answered from its own rows (``rows_of``). A single member is its
    own job."""
    if len(members) == 1:
        return members[0]
    first = members[0]
    return Job(first.deadline, min(m.received for m in members),
               request_id=",".join(m.request_id for m in members if m.request_id),
               inputs={name: np.concatenate([m.inputs[name] for m in members])
                       for name in first.inputs},
               rows=sum(m.rows for m in members), outputs=first.outputs, members=list(members))


def group_key(job: Job) -> tuple:
    """Jobs with equal keys can run as one group."""
    return (job.deadline.end, job.deadline.label, tuple(job.outputs),
            tuple((name, value.dtype.str, value.shape[1:]) for name, value in job.inputs.items()))


def rows_of(outputs: dict, members: list[Job], rows: int, names: list[str]) -> list[dict]:
    """A group's outputs ``names`` back by its members' rows (views). Raises ValueError when
    one is missing or does not have one row per row of the group."""
    outputs = {name: outputs.get(name) for name in names}
    for name, value in outputs.items():
        if value is None:
            raise ValueError(f"the pipeline returned no output '{name}'")
        if getattr(value, "ndim", 0) == 0 or value.shape[0] != rows:
            raise ValueError(f"output '{name}' has shape {getattr(value, 'shape', ())}, not "
                             f"{rows} rows like the group")
    parts, start = [], 0
    for member in members:
        parts.append({name: value[start:start + member.rows] for name, value in outputs.items()})
        start += member.rows
    return parts


def _free_devices(job: Job) -> None:
    """Release the GPU buffers kept for ``job`` (under the pb_utils lock)."""
    for device in job.device_tensors:
        device.release()
    job.device_tensors.clear()


class Responder:
    def __init__(self, pb_utils, pb_lock: threading.RLock, metrics, output_dtypes: dict,
                 max_inflight: int, model: str, log,
                 finalized: threading.Event | None = None, max_queued: int = 0) -> None:
        self.pb, self.pb_lock, self.metrics, self.log = pb_utils, pb_lock, metrics, log
        # Set as finalize ends: no pb_utils call after it (a loop that outlived finalize's
        # bounded wait finds it set).
        self.finalized = finalized or threading.Event()
        self.output_dtypes, self.model = output_dtypes, model
        self.max_inflight, self.max_queued = max_inflight, max_queued
        # Room for the requests admitted and not yet answered: running, or waiting for a slot.
        self.room = threading.BoundedSemaphore(max_inflight + max_queued)
        self._lock = threading.Lock()
        self.pending: set[Job] = set()  # admitted and not yet answered
        self.running = 0                # event loop only: jobs holding a slot
        self.waiting: deque[Job] = deque()  # event loop only: admitted jobs waiting for a slot

    # -- admission (execute's thread) -------------------------------------------------------
    def admit(self, jobs: list[Job], start) -> None:
        """Take room for each of ``jobs`` (in order) and ``start`` it; a job whose deadline
        passes while ``execute`` waits for room is answered UNAVAILABLE instead. The jobs
        admitted one after the other without waiting are started together, in one call (so
        their first sub-requests can go as one group), before any wait. The wait is bounded by
        the earliest deadline among the waiting jobs, so each is answered when its deadline
        passes, not when room frees. A job that had to wait has ``cancelled`` None (ask the
        client again: it may have gone meanwhile)."""
        waiting, run = deque(jobs), []
        while waiting:
            waited = False
            if not self.room.acquire(blocking=False):
                if run:
                    start(run)
                    run = []
                waited = True
                earliest = min(job.deadline.end for job in waiting)
                if not self.room.acquire(timeout=max(0.0, earliest - time.monotonic())):
                    now = time.monotonic()
                    for job in [job for job in waiting if job.deadline.end <= now]:
                        waiting.remove(job)
                        self.expire(job)
                    continue
            job = waiting.popleft()
            with self._lock:
                job.admitted = True
                self.pending.add(job)
            self.metrics.increment("bls_inflight_requests", +1)
            job.cancelled = None if waited else False
            run.append(job)
        if run:
            start(run)

    def expire(self, job: Job) -> None:
        """Answer a job whose deadline passed before it got a slot."""
        self.metrics.increment("bls_deadline_exceeded_total", stage=ADMISSION)
        self.answer(job, error=SlotWaitExpired(self.model, job.deadline.budget_ms,
                                               job.deadline.label, self.max_inflight))

    # -- slots (the event loop's thread) ----------------------------------------------------
    def enter(self, jobs: list[Job], run, loop) -> None:
        """Admitted jobs reach the event loop: each gets a slot, or waits for one (first come,
        first served) until its deadline. Those that got one go to ``run(jobs)`` together."""
        started = []
        for job in jobs:
            if self.running < self.max_inflight and not self.waiting:
                self.running += 1
                job.running = True
                started.append(job)
            else:
                job.cancelled = None  # it waits: ask the client again before its first stage
                job.expiry = loop.call_later(max(0.0, job.deadline.end - time.monotonic()),
                                             self._expired, job)
                self.waiting.append(job)
        if started:
            run(started)

    def leave(self, jobs: list[Job], run) -> None:
        """Running jobs were answered: their slots go to the next jobs waiting for one, handed
        to ``run(jobs)`` together (unless ``run`` is None)."""
        for job in jobs:
            if job.running:
                job.running = False
                self.running -= 1
        following = []
        while run is not None and self.waiting and self.running < self.max_inflight:
            job = self.waiting.popleft()
            if job.answered:  # shutdown answered it
                continue
            job.expiry.cancel()
            self.running += 1
            job.running = True
            following.append(job)
        if following:
            run(following)

    def _expired(self, job: Job) -> None:
        if job.running:
            return
        try:
            self.waiting.remove(job)  # at most max_queued long
        except ValueError:
            pass
        self.expire(job)

    # -- answers (any thread; a started job's only from the event loop or, after it stopped,
    # from shutdown) --------------------------------------------------------------------------
    def answer(self, job: Job, outputs: dict | None = None,
               error: PipelineError | None = None) -> None:
        """Answer ``job`` with ``outputs`` or ``error``, unless it was answered already. Never
        raises."""
        with self._lock:
            if job.answered:
                return
            job.answered = True
            sender, job.sender = job.sender, None
            admitted, by_return = job.admitted, job.by_return
            self.pending.discard(job)
        code = "SEND_FAILED"
        response = None
        try:
            code, response = self._response(job, outputs, error)
            if self.finalized.is_set():
                code, response = "SEND_FAILED", None
            if response is not None:
                if by_return:
                    job.returned, response = response, None  # execute returns it
                else:
                    try:
                        sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    except Exception:  # noqa: BLE001 - the sender is closed now (r24.10): no retry
                        self.log(f"could not send the response of '{job.request_id}':\n"
                                 f"{traceback.format_exc()}", error=True)
                        code = "SEND_FAILED"
            else:
                code = "SEND_FAILED"
        except Exception:  # noqa: BLE001 - nothing here may take the slot with it
            self.log(f"answering '{job.request_id}' failed:\n{traceback.format_exc()}", error=True)
            code = "SEND_FAILED"
        finally:
            try:
                with self.pb_lock:  # backend objects die under the pb_utils lock
                    _free_devices(job)  # answered: its GPU buffers can go
                    del response, sender
            finally:
                job.inputs = {}  # a job answered while waiting keeps no memory until popped
                if admitted:
                    self.room.release()
                    self.metrics.increment("bls_inflight_requests", -1)
                if job.done is not None:
                    job.done.set()
                self.metrics.increment("bls_requests_total", code=code)
                self.metrics.observe("bls_request_latency_seconds",
                                     time.monotonic() - job.received)

    def to_senders(self, jobs: list[Job]) -> list[Job]:
        """``execute`` stops waiting for ``jobs``: those not answered yet will be answered
        through their senders; returns those answered (or being answered) through
        ``execute``'s return value. Decided under the lock ``answer`` claims a job under, so
        each answer goes one way only."""
        with self._lock:
            for job in jobs:
                if not job.answered:
                    job.by_return = False
            return [job for job in jobs if job.by_return]

    def release(self, job: Job) -> None:
        """A group is over: its stacked inputs and the GPU buffers its stages kept go. Never
        raises."""
        job.inputs = {}
        try:
            with self.pb_lock:  # backend objects die under the pb_utils lock
                _free_devices(job)
        except Exception:  # noqa: BLE001
            self.log(f"releasing group '{job.request_id}' failed:\n{traceback.format_exc()}",
                     error=True)

    def _response(self, job: Job, outputs: dict | None, error: PipelineError | None):
        """(code, response) for the answer: the outputs, else the error, else INTERNAL when the
        response could not be built; (SEND_FAILED, None) if not even that can be built."""
        if error is None:
            try:
                return "SUCCESS", self._outputs_response(job, outputs)
            except Exception:  # noqa: BLE001 - the orchestrator's own failure: the client hears INTERNAL
                self.log(f"the response of '{job.request_id}' could not be built:\n"
                         f"{traceback.format_exc()}", error=True)
                error = internal_error(self.model)
        for answer in (error, internal_error(self.model)):  # the error, else a plain INTERNAL
            try:
                return answer.code.value, self._error_response(answer.message, answer.code)
            except Exception:  # noqa: BLE001
                self.log(f"an error response for '{job.request_id}' could not be built:\n"
                         f"{traceback.format_exc()}", error=True)
        return "SEND_FAILED", None

    def _outputs_response(self, job: Job, outputs: dict | None):
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
        with self.pb_lock:
            return self.pb.InferenceResponse(
                output_tensors=[self.pb.Tensor(name, array) for name, array in arrays])

    def _error_response(self, message: str, code: Code):
        pb = self.pb
        with self.pb_lock:
            # One TritonError per response: a shared one corrupts memory in r24.10.
            return pb.InferenceResponse(error=pb.TritonError(message, getattr(pb.TritonError,
                                                                              code.value)))

    # -- shutdown ---------------------------------------------------------------------------
    def drain(self, seconds: float) -> int:
        """Wait up to ``seconds`` for pending requests to be answered; returns how many remain."""
        give_up = time.monotonic() + seconds
        while self.pending and time.monotonic() < give_up:
            time.sleep(0.05)
        return len(self.pending)

    def answer_all(self, error: PipelineError) -> int:
        """Answer every pending request with ``error`` (shutdown, once the event loop has
        stopped); returns how many there were."""
        with self._lock:
            jobs = list(self.pending)
        for job in jobs:
            self.answer(job, error=error)
        return len(jobs)
