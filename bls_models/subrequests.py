"""Sub-requests of a pipeline: sent within the request's deadline, abandoned when it passes, their
outputs turned into numpy arrays (or kept on the GPU) while their response is alive.

Part of the orchestrator runtime (``triton_runtime`` wires it; its docstring has the design).
``InferenceRequest.exec`` blocks its thread until the sub-model answers, so each in-flight
sub-request runs on a thread of ``workers.Workers`` (``subrequest_threads``). The
``InferenceRequest`` is built on that thread just before ``exec``: its Triton ``timeout`` is the
budget left at that moment, and a part whose limit passed while it waited for a thread (or for
the stage's isolation lock) is left out, never sent. Objects that wrap backend memory are created
and destroyed under the runtime's pb_utils lock; ``exec`` and ``is_cancelled`` (round trips to
the server) are called without it.

Errors are attributed to where they happened: an error response (the sub-model's, or the python
backend's for the sub-request) is classified by ``errors.classify_sub_error``; an exception from
``exec`` or from this runtime's own code (reading outputs, a ``reduce``) is the orchestrator's own
failure, ``Kind.INTERNAL``: logged with its traceback, answered INTERNAL naming the stage, never
classified and never isolated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
import traceback

import numpy as np

from bls_models.coalescing import EXPIRED, INTERNAL, Coalescer, Outcome, Part
from bls_models.errors import (Cancelled, DeadlineExceeded, Kind, classify_sub_error,
                               internal_error, sub_request_failed)
from bls_models.params import OrchestratorConfig
from bls_models.pipelines import Reduce
from bls_models.responder import Job
from bls_models.stagelock import StageLock
from bls_models.workers import Workers

# Sub-requests and responses a thread got back from exec after the model was finalized: kept
# here, never destroyed by this runtime (destroying them is a pb_utils call); the stub process
# exits after finalize.
_LEFT_AT_SHUTDOWN: list = []


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


def _forget_cancel_answer(job: Job) -> None:
    job.cancelled, job.cancel_answer_expires = None, False


@contextlib.contextmanager
def _held():
    yield True


def _item_caused(error: str) -> bool:
    """Whether a sub-request's error may come from one item of its batch: the sub-model rejected
    the data (e.g. ONNX Runtime's "onnx runtime error 2" for a bad index). Everything else —
    queue full, not ready, shared memory, cancellation, deadlines, and a model that fails
    (out of memory, a CUDA error, anything unclassified) — concerns the stage: re-sending the
    members one by one would only multiply the load on it."""
    return classify_sub_error(error) is Kind.INVALID


def _within_limits(parts: list[Part]) -> list[Part]:
    now = time.monotonic()
    return [part for part in parts if part.expires > now]


def concatenate(parts: list[Part]) -> dict:
    """The inputs of ``parts`` as one batch, the parts' rows in order."""
    if len(parts) == 1:
        return parts[0].inputs
    return {name: np.concatenate([part.inputs[name] for part in parts])
            for name in parts[0].inputs}


def split(views: dict[str, np.ndarray], parts: list[Part]) -> list[dict]:
    """A sub-response's CPU outputs back by the parts' rows: each part's reduced by its own
    ``reduce`` (from the response's memory, while it is alive), the others as arrays the stub
    owns (``owns_memory``)."""
    owned = None
    results, start = [], 0
    for part in parts:
        rows = slice(start, start + part.rows)
        start += part.rows
        if part.reduce is not None:
            results.append(part.reduce(views if len(parts) == 1
                                       else {n: v[rows] for n, v in views.items()}))
            continue
        if owned is None:
            owned = {n: v if owns_memory(v) else v.copy() for n, v in views.items()}
        results.append(owned if len(parts) == 1 else {n: v[rows] for n, v in owned.items()})
    return results


class SubRequests:
    """The one sub-request wrapper of an orchestrator instance: ``call`` is the ``call`` its
    pipeline gets (with the job bound)."""

    def __init__(self, pb_utils, lock: threading.RLock, loop: asyncio.AbstractEventLoop,
                 metrics, config: OrchestratorConfig, pass_through: dict[str, tuple[str, ...]],
                 model: str, log, finalized: threading.Event,
                 max_rows: dict[str, int] | None = None, lock_key: str | None = None) -> None:
        self.pb, self.lock, self.loop, self.metrics, self.log = pb_utils, lock, loop, metrics, log
        self.config, self.model = config, model
        # Stage -> outputs kept on the GPU (only stages whose model is KIND_GPU, gpu_tensors on).
        self.pass_through = pass_through
        self.workers = Workers(config.subrequest_threads, f"{model}-subrequest")
        # Shutdown: no new sub-request once stopping (set under the lock); no pb_utils call at
        # all once finalized (set under the lock as finalize ends; threads check it under it).
        self.stopping = False
        self.finalized = finalized
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
                             functools.partial(self.send, stage),
                             functools.partial(self._group_sent, stage), isolate=_item_caused,
                             exclusive=self.stage_locks[stage].exclusive,
                             log=functools.partial(self._log_stage, stage))
            for stage in coalesced}

    async def call(self, job: Job, stage: str, inputs: dict[str, np.ndarray],
                   output_names, reduce: Reduce | None = None) -> dict[str, np.ndarray]:
        """The ``call`` a pipeline gets: one sub-request of ``job`` to ``stage`` (alone, or
        with others' when coalescing), raising the client's error when it fails."""
        model = self.config.stage(stage).model
        self._check_cancelled(job, stage)
        limit, what, limit_ms = job.deadline.stage_limit(self.config.stage(stage).timeout_ms)
        if limit <= 0:
            self._count_deadline(job, stage)
            raise DeadlineExceeded(stage, model, limit_ms, what)
        rows = next((len(v) for v in inputs.values() if not isinstance(v, DeviceTensor)), job.rows)
        part = Part(inputs, rows, time.monotonic() + limit, job.request_id, reduce)
        coalescer = self.coalescers.get(stage)
        # Inputs kept on the GPU (gpu_tensors on) cannot be concatenated here: sent alone, and
        # the stage model's own dynamic batcher batches them.
        if coalescer is not None and not any(isinstance(value, DeviceTensor)
                                             for value in inputs.values()):
            outcome = await coalescer.submit(part, list(output_names))
        else:
            outcome = (await self.send(stage, [part], list(output_names)))[0][0]
        # Released when the request is answered.
        job.device_tensors += [t for t in (outcome.outputs or {}).values()
                               if isinstance(t, DeviceTensor)]
        if outcome.expired:
            self._count_deadline(job, stage)
            raise DeadlineExceeded(stage, model, limit_ms, what)
        if outcome.internal:
            self._count_error(stage, Kind.INTERNAL)
            failure = internal_error(self.model, stage)
            job.stage_failure = job.stage_failure or failure
            raise failure
        if outcome.error is not None:
            failure = sub_request_failed(stage, model, outcome.error)
            self._count_error(stage, failure.kind)
            if failure.kind is not Kind.INVALID:
                job.stage_failure = job.stage_failure or failure
            raise failure
        return outcome.outputs

    def _check_cancelled(self, job: Job, stage: str) -> None:
        """Raise ``Cancelled`` if the client cancelled ``job``; for a group, if every member
        still running was cancelled (the others are answered at once, through ``job.drop``,
        and their rows go on with the group's)."""
        live = job.live()
        gone = [member for member in live if self.cancelled(member)]
        if not gone:
            return
        for member in gone:
            if member.first("cancelled"):
                self.metrics.increment("bls_cancelled_requests_total", stage=stage)
        if len(gone) == len(live):
            raise Cancelled(stage)
        for member in gone:
            job.drop(member, Cancelled(stage))

    def cancelled(self, job: Job) -> bool:
        """Whether the client cancelled ``job``, asked before each stage (on the event loop, the
        only thread that uses a started request's response sender, so never after its answer).

        Asking is an IPC round trip to the server (r24.10 ``PbCancel::IsCancelled``), so an
        answer holds until the end of this event-loop turn: branches that start together (the
        classifier and the embedder) ask once. Before the first stage, the answer Triton's
        scheduler gave as it handed the request to ``execute`` holds (``Job.cancelled``). A
        check that fails counts as not cancelled (and is logged)."""
        if self.finalized.is_set():  # no round trip after finalize: the request is over
            return True
        if job.cancelled is None:
            try:
                job.cancelled = job.sender is not None and bool(job.sender.is_cancelled())
            except Exception:  # noqa: BLE001 - the request goes on; its answer says how it ends
                self.log(f"is_cancelled() failed for '{job.request_id}':\n"
                         f"{traceback.format_exc()}", error=True)
                job.cancelled = False
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

    async def send(self, stage: str, parts: list[Part], output_names: list[str],
                   isolating: bool = False) -> tuple[list[Outcome], bool]:
        """One sub-request to ``stage``'s model for ``parts``, waited for until the latest
        part's limit: (one outcome per part, False), or (every part expired, True) when that
        limit passed first (the sub-request is then abandoned, or never sent if no thread had
        taken it yet). It holds the stage's cross-instance lock shared while out, unless it is
        an isolation's re-send (``isolating``: this process holds the lock exclusive)."""
        # Pass-through outputs stay on the GPU with gpu_tensors on; everything else comes back in
        # CPU memory, as numpy arrays the stub owns (``owns_memory``), or reduced from them.
        on_device = self.config.gpu_tensors and bool(self.pass_through.get(stage))
        keep = set(self.pass_through.get(stage, ())) if on_device else set()
        started = time.monotonic()
        future = self.workers.submit(self._exec, stage, parts, output_names, keep,
                                     None if isolating else self.stage_locks.get(stage))
        waiter = asyncio.wrap_future(future, loop=self.loop)
        try:
            done, _ = await asyncio.wait(
                {waiter}, timeout=max(0.0, max(p.expires for p in parts) - started))
        finally:
            self.metrics.observe("bls_stage_latency_seconds", time.monotonic() - started,
                                 stage=stage)
        if not done:
            waiter.cancel()
            if not future.cancel():  # already running: it finishes on its own, result dropped
                self.metrics.increment("bls_abandoned_subrequests_total", stage=stage)
                future.add_done_callback(lambda done: self._post(self._abandoned_done, stage, done))
            return [EXPIRED] * len(parts), True
        return waiter.result(), False

    def _group_sent(self, stage: str, size: int) -> None:
        self.metrics.observe("bls_coalesced_group_size", size, stage=stage)

    def _abandoned_done(self, stage: str, future: concurrent.futures.Future) -> None:
        """An abandoned sub-request finished (event loop thread): count it, free what it made."""
        self.metrics.increment("bls_abandoned_subrequests_completed_total", stage=stage)
        if future.cancelled() or future.exception() is not None:
            return
        with self.lock:
            for outcome in future.result():
                for value in (outcome.outputs or {}).values():
                    if isinstance(value, DeviceTensor):
                        value.release()

    def _exec(self, stage: str, parts: list[Part], output_names: list[str],
              keep: set[str] = frozenset(), stage_lock: StageLock | None = None) -> list[Outcome]:
        """On a sub-request thread: build the sub-request from the parts still within their
        limits, send it, wait, then split its outputs by rows (see ``split``). Outputs named in
        ``keep`` that arrive in GPU memory stay there, as ``DeviceTensor``s (a single part only:
        such stages are not coalesced). With ``stage_lock``, the sub-request is out only while
        holding it shared. Never raises: one outcome per part."""
        pb = self.pb
        request = response = None
        views: dict[str, np.ndarray] = {}
        devices: dict[str, DeviceTensor] = {}
        try:
            live = _within_limits(parts)
            if not live:
                return [EXPIRED] * len(parts)
            with (stage_lock.shared(max(p.expires for p in live)) if stage_lock
                  else _held()) as held:
                live = _within_limits(live) if held else []  # the lock may have taken a while
                if not live:
                    return [EXPIRED] * len(parts)
                inputs = concatenate(live)
                with self.lock:
                    if self.stopping:
                        return [INTERNAL] * len(parts)
                    request = pb.InferenceRequest(
                        model_name=self.config.stage(stage).model,
                        inputs=[value.as_input(pb, name) if isinstance(value, DeviceTensor)
                                else pb.Tensor(name, value) for name, value in inputs.items()],
                        requested_output_names=list(output_names),
                        request_id=",".join(p.request_id for p in live if p.request_id),
                        # µs left now; applies in the sub-model's queue
                        timeout=max(1, int((max(p.expires for p in live) - time.monotonic())
                                           * 1e6)),
                        **self._output_memory(bool(keep)))
                del inputs
                self.metrics.increment("bls_inflight_subrequests", +1)
                try:
                    response = request.exec()  # blocks (GIL released) until the answer
                finally:
                    self.metrics.increment("bls_inflight_subrequests", -1)
            sent = {id(p) for p in live}
            with self.lock:
                if self.finalized.is_set():  # no pb_utils call any more, not even a destructor
                    _LEFT_AT_SHUTDOWN.append((request, response))
                    request = response = None
                    return [INTERNAL] * len(parts)
                if response.has_error():
                    error = response.error().message()
                    return [Outcome(error=error) if id(p) in sent else EXPIRED for p in parts]
                missing = take_outputs(pb, response, output_names, keep, views, devices)
                if missing is not None:
                    error = f"the response has no output '{missing}'"
                    return [Outcome(error=error) if id(p) in sent else EXPIRED for p in parts]
            # Outside the lock: numpy only, on memory the response keeps alive until the end.
            results = iter(split(views, live))
            if devices:  # a single part: stages with outputs kept on the GPU are not coalesced
                return [Outcome(outputs={**next(results), **devices})]
            return [Outcome(outputs=next(results)) if id(p) in sent else EXPIRED for p in parts]
        except BaseException:  # noqa: BLE001 - exec or this runtime failed: the stage's own failure
            self._log_stage(stage, f"sub-request failed:\n{traceback.format_exc()}")
            with self.lock:
                for device in devices.values():
                    device.release()
            return [INTERNAL] * len(parts)
        finally:
            with self.lock:  # backend objects die under the lock, on this thread
                views.clear()
                if self.finalized.is_set() and (request is not None or response is not None):
                    _LEFT_AT_SHUTDOWN.append((request, response))
                del request, response

    def _post(self, function, *args) -> None:
        """Run ``function`` on the event loop's thread (from a sub-request thread)."""
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop is closed: the model is unloading
            pass

    def _log_stage(self, stage: str, message: str) -> None:
        self.log(f"stage '{stage}': {message}", error=True)

    def _count_error(self, stage: str, kind: Kind) -> None:
        self.metrics.increment("bls_subrequest_errors_total", stage=stage, kind=kind.value)

    def _count_deadline(self, job: Job, stage: str) -> None:
        """A sub-request failed on the deadline: counted per sub-request (the stage's errors),
        and the request's deadline once per request, at the first stage that hit it."""
        if job.first("deadline"):
            self.metrics.increment("bls_deadline_exceeded_total", len(job.live()) or 1,
                                   stage=stage)
        self._count_error(stage, Kind.DEADLINE)

    def close(self, seconds: float) -> int:
        """Shutdown: no new sub-request; wait up to ``seconds`` for the threads' sub-requests to
        come back. Returns how many threads were still waiting on a sub-model: they are left to
        the process's exit, and make no pb_utils call once ``finalized`` is set."""
        with self.lock:
            self.stopping = True
        return len(self.workers.shutdown(seconds))
