"""Runs a pipeline inside a Triton python-backend model: the only module that uses ``pb_utils``.

Design (docs/orchestrator.md has the measurements behind it):

* **Concurrency.** In Triton 2.51 a non-decoupled model's ``execute`` — async or not — is not
  re-entered until it returns, so a request waiting on a slow sub-model would hold up every
  request behind it. Here ``execute`` only takes each request's inputs, deadline and response
  sender, hands the request to an event loop this object owns (on its own thread) and returns
  ``None``; each request is answered later, exactly once, through its response sender. Plain
  unary HTTP and gRPC clients work unchanged (the model is not decoupled).
* **Sub-requests.** ``InferenceRequest.exec`` blocks its thread until the sub-model answers, so
  each in-flight sub-request runs on a thread of a dedicated pool (``subrequest_threads``,
  instead of asyncio's default executor of ``min(32, cores + 4)`` threads).
* **One lock for pb_utils.** Using ``pb_utils`` from several threads at once crashed stubs under
  bursts on this build. Every ``pb_utils`` call — reading requests, building sub-requests,
  reading sub-responses, metrics, cancellation checks, sending responses — holds ``self.lock``,
  except the blocking wait inside ``exec`` itself (holding it there would serialise
  sub-requests; concurrent ``exec`` is what the backend's own ``async_exec`` does). Python
  objects that wrap backend memory are created and destroyed under the lock. A sub-response's
  outputs are turned into plain numpy arrays (copied, or reduced in place as the tagger's 28.7 MB
  logits are) on the sub-request's thread while the response is still alive, so nothing that
  points into shared memory outlives its owner.
* **Deadlines.** Each sub-request gets the request's remaining budget (capped by its stage's
  timeout) twice: as its Triton ``timeout`` (so the sub-model's queue drops it) and as a limit on
  the wait here (so a sub-request that is already running cannot hold the request). A sub-request
  given up on keeps its thread until the sub-model answers (r24.10 cannot cancel it); it is
  counted as abandoned and its result dropped. One whose deadline passed before a thread picked
  it up is never sent.
* **GPU tensors** (``gpu_tensors: "on"``). Outputs that only flow into other stages
  (a stage's ``pass_through`` in its ``PipelineDef``, e.g. preprocess's PIXELS) are requested in GPU memory and kept as a
  ``DeviceTensor``: a DLPack-made ``pb_utils.Tensor`` that owns the sub-model's GPU buffer, never
  ``as_numpy()``-ed. It becomes the next stages' input by DLPack again, so the 602 KB per image
  never crosses to the host. Every other output is copied to numpy as before, and so is a
  pass-through output that arrives in CPU memory (CPU-only host): the fallback. Device tensors
  are released under the lock when their request is answered, or when an abandoned sub-request
  that made them finishes.
* **Backpressure.** At most ``max_inflight_requests`` requests per instance are in flight;
  beyond that ``execute`` waits, so further requests stay in Triton's bounded, timeout-aware
  queue of this model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bls_models import params, repository
from bls_models import spec as S
from bls_models.deadline import Deadline
from bls_models.definition import PipelineDef, Setup, registered
from bls_models.errors import (Cancelled, Code, DeadlineExceeded, Kind, PipelineError,
                               sub_request_failed)
from bls_models.metrics import FLUSH_SECONDS, Metrics
from bls_models.pipelines import Reduce

_NUMPY = {name: np.dtype(dtype) for name, dtype in S.DTYPES.items()}
SHUTDOWN_DRAIN_SECONDS = 10.0


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
            views[name] = tensor.as_numpy()  # a view of the response's memory: never of a GPU one
    return None


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
class Job:
    """One client request, from ``execute`` until its response is sent."""

    inputs: dict[str, np.ndarray]
    outputs: list[str]
    deadline: Deadline
    request_id: str        # forwarded to every sub-request
    sender: object         # pb_utils InferenceResponseSender; None once answered
    received: float = field(default_factory=time.monotonic)
    # Stage outputs kept on the GPU for this request; released when it is answered.
    device_tensors: list[DeviceTensor] = field(default_factory=list)
    # Per-request events already counted: concurrent branches both see a cancellation or a
    # passed deadline, and each counter counts once per request and event.
    counted: set[str] = field(default_factory=set)


@dataclass
class Outcome:
    """What a sub-request thread hands back: numpy arrays, and device tensors for pass-through
    outputs kept on the GPU (``gpu_tensors: "on"``)."""

    outputs: dict[str, np.ndarray | DeviceTensor] | None = None
    error: str | None = None
    expired: bool = False  # its deadline passed before a thread picked it up: never sent

    def device_tensors(self) -> list[DeviceTensor]:
        return [t for t in (self.outputs or {}).values() if isinstance(t, DeviceTensor)]


class Orchestrator:
    def __init__(self, pb_utils, args: dict, pipeline: PipelineDef | str) -> None:
        self.pb = pb_utils
        self.model = args["model_name"]
        config = json.loads(args["model_config"])
        self.definition = pipeline if isinstance(pipeline, PipelineDef) else registered(pipeline)
        self.config = self.definition.parse(params.string_parameters(config))
        # This model's own repository first (the parent of its directory), then any others.
        repositories = [Path(args["model_repository"]).parent,
                        *(Path(p) for p in self.config.stage_model_repositories)]
        # Which contract each stage model meets decides, e.g., whether the tagger reduces.
        self.contracts, problems = repository.resolve_stages(repositories, self.config.stages,
                                                             self.definition.contracts)
        if problems:
            raise params.ConfigError("; ".join(problems))
        self.run = self.definition.run_function()
        self.setup = Setup(options=self.config.options, contracts=self.contracts)
        self.input_names = [t["name"] for t in config["input"]]
        self.output_dtypes = {t["name"]: _NUMPY[t["data_type"]] for t in config["output"]}
        # gpu_tensors: a stage's pass-through outputs stay on the GPU only if its model is
        # configured KIND_GPU (the GPU profiles). Asking a CPU instance for GPU output memory
        # fails the sub-request ("BackendMemory::Create, all allocation types failed", verified
        # on this build), so KIND_AUTO/KIND_CPU stages (the portable repository, CPU hosts) keep
        # the copy: the fallback.
        kinds = repository.stage_kinds(repositories, self.config.stages)
        self.pass_through = {
            stage: names for stage, names in self.definition.pass_through.items()
            if self.config.gpu_tensors and kinds.get(stage) == {"KIND_GPU"}}

        # Re-entrant: logging (a pb_utils call) takes it too, also from code that holds it.
        self.lock = threading.RLock()
        self.slots = threading.BoundedSemaphore(self.config.max_inflight_requests)
        self.subrequests = concurrent.futures.ThreadPoolExecutor(
            self.config.subrequest_threads, thread_name_prefix=f"{self.model}-subrequest")
        self.metrics = Metrics(pb_utils, self.model, stages=list(self.config.stages))
        self.tasks: set[asyncio.Task] = set()
        self.pending = 0  # requests taken by execute and not yet answered (under the lock)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"{self.model}-loop",
                                       daemon=True)
        self.thread.start()
        self.loop.call_soon_threadsafe(self._flush_metrics)
        self.log(f"orchestrating '{self.definition.name}': " + ", ".join(
            f"{s.name} -> {s.model} (as {self.contracts[s.name].name})"
            + (f" (timeout {s.timeout_ms} ms)" if s.timeout_ms else "")
            for s in self.config.stages.values())
            + f"; default deadline {self.config.default_deadline_ms} ms, "
            f"{self.config.concurrency_mode}"
            + "".join(f", {name} {value}" for name, value in self.config.options.items()))
        if self.config.gpu_tensors:
            kept = [f"{stage}'s {', '.join(names)}" for stage, names in self.pass_through.items()]
            copied = [stage for stage in self.definition.pass_through
                      if stage not in self.pass_through]
            self.log("gpu_tensors on: " + (f"kept on the GPU: {'; '.join(kept)}" if kept else
                                            "nothing kept on the GPU")
                     + (f"; copied to CPU (stage model not KIND_GPU): {', '.join(copied)}"
                        if copied else ""))

    # -- execute (the stub's main thread) ---------------------------------------------------
    def execute(self, requests) -> None:
        started = []
        for request in requests:
            self.slots.acquire()  # backpressure: wait here, outside the lock
            with self.lock:
                sender = request.get_response_sender()
                try:
                    job = self._job(request, sender)
                    self.pending += 1
                except Exception as error:  # noqa: BLE001 - this request fails alone
                    job = None
                    self.log(f"could not read request '{request.request_id()}': {error}", error=True)
                    sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(
                        f"could not read the request: {error}", self.pb.TritonError.INVALID_ARG)),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                del sender
            if job is None:
                self.slots.release()
                continue
            started.append(asyncio.run_coroutine_threadsafe(self._answer(job), self.loop))
        if self.config.concurrency_mode == "batch_gather":
            # The measured alternative: one execute at a time, its requests gathered together.
            concurrent.futures.wait(started)
        return None

    def _job(self, request, sender) -> Job:
        inputs = {}
        for name in self.input_names:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            # A copy: nothing of the request's memory is used after execute returns.
            inputs[name] = np.array(tensor.as_numpy(), copy=True)
        return Job(
            inputs=inputs,
            outputs=[n for n in request.requested_output_names() if n in self.output_dtypes]
            or list(self.output_dtypes),
            deadline=Deadline.for_request(int(request.timeout()), self.config.default_deadline_ms),
            request_id=request.request_id(),
            # Not request.trace(): the request (and its trace) is released when execute returns,
            # and a sub-request spawned from that trace later segfaults Triton 2.51 when tracing
            # is on (verified). Sub-requests carry the request id instead.
            sender=sender,
        )

    # -- one request (the event loop's thread) -------------------------------------------------
    async def _answer(self, job: Job) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        self._gauge("bls_inflight_requests", +1)
        try:
            outputs = await self._run(job)
            error = None
        except PipelineError as failure:
            outputs, error = None, failure
        except asyncio.CancelledError:
            outputs, error = None, PipelineError(Code.UNAVAILABLE,
                                                 f"model '{self.model}' is shutting down")
        except Exception:  # noqa: BLE001 - a bug here must not take the request's answer with it
            self.log(f"request '{job.request_id}' failed:\n{traceback.format_exc()}", error=True)
            outputs, error = None, PipelineError(
                Code.INTERNAL, f"internal error in orchestrator '{self.model}' (see server log)")
        finally:
            self.tasks.discard(task)
        self._send(job, outputs, error)

    async def _run(self, job: Job) -> dict[str, np.ndarray]:
        return await self.run(job.inputs, functools.partial(self._call, job), self.setup)

    def _send(self, job: Job, outputs: dict[str, np.ndarray] | None,
              error: PipelineError | None) -> None:
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

    # -- the one sub-request wrapper ---------------------------------------------------------
    async def _call(self, job: Job, stage: str, inputs: dict[str, np.ndarray],
                    output_names, reduce: Reduce | None = None) -> dict[str, np.ndarray]:
        pb = self.pb
        model = self.config.stage(stage).model
        with self.lock:
            cancelled = job.sender is not None and job.sender.is_cancelled()
            if cancelled and self._first(job, "cancelled"):
                self.metrics.increment("bls_cancelled_requests_total", stage=stage)
        if cancelled:
            raise Cancelled(stage)
        limit, what, limit_ms = job.deadline.stage_limit(self.config.stage(stage).timeout_ms)
        if limit <= 0:
            self._count_deadline(job, stage)
            raise DeadlineExceeded(stage, model, limit_ms, what)

        # Pass-through outputs stay on the GPU with gpu_tensors on; everything else comes back in
        # CPU memory, where it is copied into numpy (or reduced in place).
        on_device = self.config.gpu_tensors and bool(self.pass_through.get(stage))
        with self.lock:
            request = pb.InferenceRequest(
                model_name=model,
                inputs=[value.as_input(pb, name) if isinstance(value, DeviceTensor)
                        else pb.Tensor(name, value) for name, value in inputs.items()],
                requested_output_names=list(output_names),
                request_id=job.request_id,
                timeout=max(1, int(limit * 1e6)),  # µs; applies in the sub-model's queue
                preferred_memory=pb.PreferredMemory(
                    pb.TRITONSERVER_MEMORY_GPU if on_device else pb.TRITONSERVER_MEMORY_CPU, 0),
            )
        handoff = [request]  # the thread takes the only reference
        del request
        started = time.monotonic()
        keep = set(self.pass_through.get(stage, ())) if on_device else set()
        future = self.subrequests.submit(self._exec, handoff, started + limit, list(output_names),
                                         reduce, keep)
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
            self._count_deadline(job, stage)
            raise DeadlineExceeded(stage, model, limit_ms, what)
        outcome: Outcome = waiter.result()
        if outcome.expired:
            self._count_deadline(job, stage)
            raise DeadlineExceeded(stage, model, limit_ms, what)
        job.device_tensors += outcome.device_tensors()  # released when the request is answered
        if outcome.error is not None:
            failure = sub_request_failed(stage, model, outcome.error)
            self._count("bls_subrequest_errors_total", stage, kind=failure.kind.value)
            raise failure
        return outcome.outputs

    def _abandoned_done(self, stage: str, future: concurrent.futures.Future) -> None:
        """An abandoned sub-request finished (event loop thread): count it, free what it made."""
        self._count("bls_abandoned_subrequests_completed_total", stage)
        if not future.cancelled() and future.exception() is None:
            with self.lock:
                for device in future.result().device_tensors():
                    device.release()

    def _exec(self, handoff: list, expires: float, output_names: list[str],
              reduce: Reduce | None, keep: set[str] = frozenset()) -> Outcome:
        """On a sub-request thread: send, wait, then turn the outputs into plain numpy arrays
        (copies, or whatever ``reduce`` computes from them in place). Outputs named in ``keep``
        that arrive in GPU memory stay there, as ``DeviceTensor``s."""
        pb = self.pb
        request = handoff.pop()
        response = None
        views: dict[str, np.ndarray] = {}
        devices: dict[str, DeviceTensor] = {}
        try:
            if time.monotonic() >= expires:
                return Outcome(expired=True)
            self._gauge("bls_inflight_subrequests", +1)
            try:
                response = request.exec()  # blocks (GIL released) until the sub-model answers
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
            return Outcome(outputs={**{name: view.copy() for name, view in views.items()},
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

    # -- metrics helpers (event loop thread) ------------------------------------------------------
    def _flush_metrics(self) -> None:
        """Publish pending counter/gauge increments, then again in FLUSH_SECONDS."""
        with self.lock:
            self.metrics.flush()
        self.loop.call_later(FLUSH_SECONDS, self._flush_metrics)

    def _count(self, family: str, stage: str, **labels: str) -> None:
        with self.lock:
            self.metrics.increment(family, stage=stage, **labels)

    @staticmethod
    def _first(job: Job, event: str) -> bool:
        """Whether ``event`` happens to ``job`` for the first time (under the lock)."""
        first = event not in job.counted
        job.counted.add(event)
        return first

    def _count_deadline(self, job: Job, stage: str) -> None:
        """A sub-request failed on the deadline: counted per sub-request (the stage's errors),
        and the request's deadline once per request, at the first stage that hit it."""
        with self.lock:
            if self._first(job, "deadline"):
                self.metrics.increment("bls_deadline_exceeded_total", stage=stage)
            self.metrics.increment("bls_subrequest_errors_total", stage=stage,
                                   kind=Kind.DEADLINE.value)

    def _gauge(self, family: str, delta: float) -> None:
        with self.lock:
            self.metrics.increment(family, delta)

    def log(self, message: str, error: bool = False) -> None:
        logger = self.pb.Logger
        with self.lock:
            (logger.log_error if error else logger.log_info)(f"[{self.model}] {message}")

    # -- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain in-flight requests (bounded), answer the rest with UNAVAILABLE, stop threads."""
        deadline = time.monotonic() + SHUTDOWN_DRAIN_SECONDS
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.pending:
            self.log(f"cancelling {self.pending} request(s) still in flight at shutdown")
            cancel = asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop)
            cancel.result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.subrequests.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            self.metrics.close()

    async def _cancel_all(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def python_model(pipeline: PipelineDef | str) -> type:
    """The ``TritonPythonModel`` class of an orchestrator running ``pipeline`` (a definition, or
    the name of a registered one). A model.py is then one line: ``TritonPythonModel =
    python_model(...)``; every request is answered through its response sender."""
    name = pipeline if isinstance(pipeline, str) else pipeline.name

    class TritonPythonModel:
        def initialize(self, args):
            import triton_python_backend_utils as pb_utils

            self.orchestrator = Orchestrator(pb_utils, args, pipeline)

        def execute(self, requests):
            return self.orchestrator.execute(requests)

        def finalize(self):
            self.orchestrator.close()

    TritonPythonModel.pipeline = pipeline  # what modelgen.configs renders the config from
    TritonPythonModel.__qualname__ = f"TritonPythonModel[{name}]"
    return TritonPythonModel
