"""Sub-requests of a pipeline: sent with the request's deadline, abandoned when it passes, their
outputs turned into numpy arrays (or kept on the GPU) while their response is alive.

Part of the orchestrator runtime (``triton_runtime`` wires it; its docstring has the design).
``InferenceRequest.exec`` blocks its thread until the sub-model answers, so each in-flight
sub-request runs on a thread of a dedicated pool (``subrequest_threads``). Every other
``pb_utils`` call holds the runtime's lock; objects that wrap backend memory are created and
destroyed under it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
from dataclasses import dataclass

import numpy as np

from bls_models.coalescing import Coalescer
from bls_models.errors import (Cancelled, DeadlineExceeded, Kind, classify_sub_error,
                               sub_request_failed)
from bls_models.params import OrchestratorConfig
from bls_models.pipelines import Reduce
from bls_models.responder import Job
from bls_models.stagelock import StageLock


def take_outputs(pb_utils, response, names, keep, views: dict, devices: dict) -> str | None:
    """Read a sub-response's outputs (under the lock): ``views`` gets numpy views of those in CPU
    memory, ``devices`` a ``DeviceTensor`` for each output named in ``keep`` that is in GPU memory.
    A kept output that arrived in CPU memory (a CPU-only host) becomes a view: the fallback.
    Returns the name of a missing output (nothing is kept then), or None."""
    for name in names:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is None:
            for device in devices.values():
                device.release()
            devices.clear()
            views.clear()
            return name
        if name in keep and not tensor.is_cpu():
            devices[name] = DeviceTensor(pb_utils.Tensor.from_dlpack(name, tensor.to_dlpack()))
        else:
            views[name] = tensor.as_numpy()  # CPU memory: never a GPU one's
    return None


def owns_memory(array: np.ndarray) -> bool:
    """Whether ``array``'s memory was allocated by numpy (for it or an array it views), not
    borrowed from a foreign buffer such as a response's shared memory.

    The python backend (r24.10, ``PbTensor``'s constructors in the stub) builds a CPU output's
    numpy array with ``py::array(dtype, dims, ptr)`` and no base, which pybind11 answers with a
    copy: ``as_numpy()`` of a sub-response's output is already the stub's own memory, copied while
    the response loads (the stub's private memory grows by the output's size during ``exec``,
    measured). Copying it again cost a memcpy and an allocation per output. A build that hands out
    views of the shared memory instead gets the copy, because such an array does not own it."""
    while isinstance(array, np.ndarray) and not array.flags.owndata:
        array = array.base
    return isinstance(array, np.ndarray)


class DeviceTensor:
    """A stage output kept in the sub-model's GPU memory (``gpu_tensors: "on"``).

    Wraps a ``pb_utils.Tensor`` made with ``from_dlpack``, which shares ownership of the GPU
    buffer with the DLPack capsule, not with the sub-response: the response can go. Created and
    released under the runtime's lock, like every object that wraps backend memory; pipelines
    only pass it from one stage to the next (they never compute on it)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def as_input(self, pb_utils, name: str):
        """A new input tensor named ``name`` over the same GPU buffer (under the lock)."""
        if self.tensor is None:
            raise RuntimeError("a released DeviceTensor was used as an input")
        return pb_utils.Tensor.from_dlpack(name, self.tensor.to_dlpack())

    def release(self) -> None:
        self.tensor = None


@dataclass
class Outcome:
    """What a sub-request thread hands back: numpy arrays, and device tensors for pass-through
    outputs kept on the GPU (``gpu_tensors: "on"``)."""

    outputs: dict[str, np.ndarray | DeviceTensor] | None = None
    error: str | None = None
    expired: bool = False  # its deadline passed before a thread picked it up: never sent

    def device_tensors(self) -> list[DeviceTensor]:
        return [t for t in (self.outputs or {}).values() if isinstance(t, DeviceTensor)]


def _forget_cancel_answer(job: Job) -> None:
    job.cancelled, job.cancel_answer_expires = None, False


@contextlib.contextmanager
def _held():
    yield True


def _one_bad_item(error: str) -> bool:
    """Whether a sub-request's error may come from one item of its batch: the sub-model rejected
    the data (e.g. ONNX Runtime's "onnx runtime error 2" for a bad index) or failed. Queue full,
    not ready, shared memory, cancellation and deadlines concern the stage, not an item."""
    return classify_sub_error(error) in (Kind.INVALID, Kind.FAILED)


class SubRequests:
    """The one sub-request wrapper of an orchestrator instance: ``call`` is the ``call`` its
    pipeline gets (with the job bound)."""

    def __init__(self, pb_utils, lock: threading.RLock, loop: asyncio.AbstractEventLoop,
                 metrics, config: OrchestratorConfig, pass_through: dict[str, tuple[str, ...]],
                 model: str, max_rows: dict[str, int] | None = None,
                 lock_key: str | None = None) -> None:
        self.pb, self.lock, self.loop, self.metrics = pb_utils, lock, loop, metrics
        self.config = config
        # Stage -> outputs kept on the GPU (only stages whose model is KIND_GPU, gpu_tensors on).
        self.pass_through = pass_through
        self.pool = concurrent.futures.ThreadPoolExecutor(
            config.subrequest_threads, thread_name_prefix=f"{model}-subrequest")
        # coalesce on: a Coalescer per stage whose outputs come back to the CPU (device tensors
        # cannot be split by rows), sized by the stage model's max_batch_size.
        coalesced = [stage for stage in config.stages
                     if config.coalesce and max_rows and max_rows.get(stage, 0) > 0
                     and stage not in pass_through]
        # Isolation across this orchestrator's instances (stagelock.py): every sub-request to a
        # coalesced stage holds its lock shared, an isolation exclusive.
        self.stage_locks: dict[str, StageLock] = {
            stage: StageLock(lock_key or model, stage) for stage in coalesced}
        self.coalescers: dict[str, Coalescer] = {
            stage: Coalescer(max_rows[stage], config.coalesce_in_flight,
                             functools.partial(self._send, stage), Outcome,
                             functools.partial(self._group_sent, stage), isolate=_one_bad_item,
                             exclusive=self.stage_locks[stage].exclusive)
            for stage in coalesced}

    async def call(self, job: Job, stage: str, inputs: dict[str, np.ndarray],
                   output_names, reduce: Reduce | None = None) -> dict[str, np.ndarray]:
        """The ``call`` a pipeline gets: one sub-request of ``job`` to ``stage`` (alone, or
        with others' when coalescing), raising the client's error when it fails."""
        model = self.config.stage(stage).model
        if self.cancelled(job):
            with self.lock:
                if job.first("cancelled"):
                    self.metrics.increment("bls_cancelled_requests_total", stage=stage)
            raise Cancelled(stage)
        limit, what, limit_ms = job.deadline.stage_limit(self.config.stage(stage).timeout_ms)
        if limit <= 0:
            self._count_deadline(job, stage)
            raise DeadlineExceeded(stage, model, limit_ms, what)
        coalescer = self.coalescers.get(stage)
        # Inputs kept on the GPU (gpu_tensors on) cannot be concatenated here: sent alone, and
        # the stage model's own dynamic batcher batches them.
        if coalescer is not None and not any(isinstance(value, DeviceTensor)
                                             for value in inputs.values()):
            outcome, timed_out = await coalescer.submit(inputs, list(output_names), reduce, limit,
                                                        job.request_id)
        else:
            outcome, timed_out = await self._send(stage, inputs, list(output_names), reduce,
                                                  limit, job.request_id)
        if timed_out or outcome.expired:
            self._count_deadline(job, stage)
            raise DeadlineExceeded(stage, model, limit_ms, what)
        job.device_tensors += outcome.device_tensors()  # released when the request is answered
        if outcome.error is not None:
            failure = sub_request_failed(stage, model, outcome.error)
            self._count("bls_subrequest_errors_total", stage, kind=failure.kind.value)
            raise failure
        return outcome.outputs

    def cancelled(self, job: Job) -> bool:
        """Whether the client cancelled ``job``, asked before each stage (on the event loop).

        Asking is an IPC round trip to the server (r24.10 ``PbCancel::IsCancelled``), so an
        answer holds until the end of this event-loop turn: branches that start together (the
        classifier and the embedder) ask once. Before the first stage, the answer Triton's
        scheduler gave as it handed the request to ``execute`` holds (``Job.cancelled``)."""
        if job.cancelled is None:
            with self.lock:
                job.cancelled = job.sender is not None and job.sender.is_cancelled()
        if not job.cancelled and not job.cancel_answer_expires:
            job.cancel_answer_expires = True
            self.loop.call_soon(_forget_cancel_answer, job)
        return job.cancelled

    def _output_memory(self, on_device: bool) -> dict:
        """Where a sub-response's outputs are asked for. Pass-through outputs kept on the GPU:
        no preference, which in r24.10 means the memory the stage's instance produced them in,
        its own GPU (python_backend request_executor.cc, ResponseAlloc: the backend's preferred
        type and device id; the onnxruntime backend prefers its instance's GPU). Naming a device
        instead would put every output on that one GPU, and an orchestrator cannot name the
        right one: the scheduler picks the stage's instance, on any GPU, and a KIND_CPU
        instance's ``model_instance_device_id`` is always 0 (core backend_model.cc). Everything
        else: CPU memory, where it becomes numpy."""
        if on_device:
            return {}
        return {"preferred_memory": self.pb.PreferredMemory(self.pb.TRITONSERVER_MEMORY_CPU, 0)}

    async def _send(self, stage: str, inputs: dict, output_names: list[str],
                    reduce: Reduce | None, limit: float, request_id: str
                    ) -> tuple[Outcome | None, bool]:
        """One sub-request to ``stage``'s model, waited for at most ``limit`` seconds:
        (outcome, False), or (None, True) when the limit passed first (it is then abandoned, or
        never sent if no thread had taken it yet)."""
        pb = self.pb
        model = self.config.stage(stage).model
        # Pass-through outputs stay on the GPU with gpu_tensors on; everything else comes back in
        # CPU memory, as numpy arrays the stub owns (``owns_memory``), or reduced from them.
        on_device = self.config.gpu_tensors and bool(self.pass_through.get(stage))
        with self.lock:
            request = pb.InferenceRequest(
                model_name=model,
                inputs=[value.as_input(pb, name) if isinstance(value, DeviceTensor)
                        else pb.Tensor(name, value) for name, value in inputs.items()],
                requested_output_names=list(output_names),
                request_id=request_id,
                timeout=max(1, int(limit * 1e6)),  # µs; applies in the sub-model's queue
                **self._output_memory(on_device),
            )
        handoff = [request]  # the thread takes the only reference
        del request
        started = time.monotonic()
        keep = set(self.pass_through.get(stage, ())) if on_device else set()
        future = self.pool.submit(self._exec, handoff, started + limit, list(output_names),
                                  reduce, keep, self.stage_locks.get(stage))
        waiter = asyncio.wrap_future(future, loop=self.loop)
        try:
            done, _ = await asyncio.wait({waiter}, timeout=limit)
        finally:
            with self.lock:
                self.metrics.observe("bls_stage_latency_seconds", time.monotonic() - started,
                                     stage=stage)
        if not done:
            waiter.cancel()
            if not future.cancel():  # already running: it finishes on its own, result dropped
                with self.lock:
                    self.metrics.increment("bls_abandoned_subrequests_total", stage=stage)
                future.add_done_callback(lambda done: self._post(self._abandoned_done, stage, done))
            return None, True
        return waiter.result(), False

    def _group_sent(self, stage: str, size: int) -> None:
        with self.lock:
            self.metrics.observe("bls_coalesced_group_size", size, stage=stage)

    def _abandoned_done(self, stage: str, future: concurrent.futures.Future) -> None:
        """An abandoned sub-request finished (event loop thread): count it, free what it made."""
        self._count("bls_abandoned_subrequests_completed_total", stage)
        if not future.cancelled() and future.exception() is None:
            with self.lock:
                for device in future.result().device_tensors():
                    device.release()

    def _exec(self, handoff: list, expires: float, output_names: list[str],
              reduce: Reduce | None, keep: set[str] = frozenset(),
              stage_lock: StageLock | None = None) -> Outcome:
        """On a sub-request thread: send, wait, then turn the outputs into plain numpy arrays the
        stub owns (``owns_memory``: the backend's own copies, else copies made here), or whatever
        ``reduce`` computes from them. Outputs named in ``keep``
        that arrive in GPU memory stay there, as ``DeviceTensor``s. With ``stage_lock``, the
        sub-request is out only while holding it shared (not sent at all if another instance's
        isolation outlasts its deadline)."""
        pb = self.pb
        request = handoff.pop()
        response = None
        views: dict[str, np.ndarray] = {}
        devices: dict[str, DeviceTensor] = {}
        try:
            if time.monotonic() >= expires:
                return Outcome(expired=True)
            with (stage_lock.shared(expires) if stage_lock else _held()) as held:
                if not held:
                    return Outcome(expired=True)
                self._gauge("bls_inflight_subrequests", +1)
                try:
                    response = request.exec()  # blocks (GIL released) until the answer
                finally:
                    self._gauge("bls_inflight_subrequests", -1)
            with self.lock:
                if response.has_error():
                    return Outcome(error=response.error().message())
                missing = take_outputs(pb, response, output_names, keep, views, devices)
                if missing is not None:
                    return Outcome(error=f"the response has no output '{missing}'")
            # Outside the lock: numpy only, on memory the response keeps alive until the end.
            if reduce is not None:
                return Outcome(outputs={**reduce(views), **devices})
            return Outcome(outputs={
                **{name: view if owns_memory(view) else view.copy() for name, view in views.items()},
                **devices})
        except Exception as error:  # noqa: BLE001 - exec itself raised (e.g. stub errors)
            with self.lock:
                for device in devices.values():
                    device.release()
            return Outcome(error=f"{type(error).__name__}: {error}")
        finally:
            with self.lock:  # backend objects die under the lock, on this thread
                views.clear()
                del request, response

    def _post(self, function, *args) -> None:
        """Run ``function`` on the event loop's thread (from a sub-request thread)."""
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop is closed: the model is unloading
            pass

    def _count(self, family: str, stage: str, **labels: str) -> None:
        with self.lock:
            self.metrics.increment(family, stage=stage, **labels)

    def _count_deadline(self, job: Job, stage: str) -> None:
        """A sub-request failed on the deadline: counted per sub-request (the stage's errors),
        and the request's deadline once per request, at the first stage that hit it."""
        with self.lock:
            if job.first("deadline"):
                self.metrics.increment("bls_deadline_exceeded_total", stage=stage)
            self.metrics.increment("bls_subrequest_errors_total", stage=stage,
                                   kind=Kind.DEADLINE.value)

    def _gauge(self, family: str, delta: float) -> None:
        with self.lock:
            self.metrics.increment(family, delta)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
