"""Runs a pipeline inside a Triton python-backend model: the wiring of the runtime.

The runtime is three parts, and only they use ``pb_utils``:

* this module: ``execute`` (turns requests into jobs), the event loop on its own thread that
  runs each job's pipeline, metrics flushing, shutdown, and ``python_model`` (a model.py's class);
* ``subrequests.SubRequests``: the sub-request wrapper a pipeline calls (deadline, abandonment,
  device-tensor lifetime);
* ``responder.Responder``: exactly one answer per request, the pending count, backpressure.

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
  outputs are turned into numpy arrays the stub owns (the python backend's own copies, or
  reduced from them as the tagger's 28.7 MB logits are) on the sub-request's thread while the
  response is still alive, so nothing that points into shared memory outlives its owner.
* **Deadlines.** Each sub-request gets the request's remaining budget (capped by its stage's
  timeout) twice: as its Triton ``timeout`` (so the sub-model's queue drops it) and as a limit on
  the wait here (so a sub-request that is already running cannot hold the request). A sub-request
  given up on keeps its thread until the sub-model answers (r24.10 cannot cancel it); it is
  counted as abandoned and its result dropped. One whose deadline passed before a thread picked
  it up is never sent.
* **GPU tensors** (``gpu_tensors: "on"``). Outputs that only flow into other stages (a
  stage's ``pass_through`` in its ``PipelineDef``, e.g. preprocess's PIXELS) are left in the
  memory the stage's instance produced them in (its GPU, whichever it is) and kept as a
  ``DeviceTensor``: a DLPack-made ``pb_utils.Tensor`` that owns that GPU buffer, never
  ``as_numpy()``-ed. It becomes the next stages' input by DLPack again; Triton gives each next
  stage its own device-to-device copy, so the 602 KB per image never crosses to the host. Every
  other output is requested in CPU memory and copied to numpy as before, and so is a
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
import traceback
from pathlib import Path

import numpy as np

from bls_models import params, repository
from bls_models import spec as S
from bls_models.deadline import Deadline
from bls_models.definition import PipelineDef, Setup, registered
from bls_models.errors import Code, PipelineError
from bls_models.metrics import FLUSH_SECONDS, HISTOGRAM_FLUSH_SECONDS, Metrics
from bls_models.responder import Job, Responder
from bls_models.subrequests import SubRequests

_NUMPY = {name: np.dtype(dtype) for name, dtype in S.DTYPES.items()}
SHUTDOWN_DRAIN_SECONDS = 10.0


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
        self.metrics = Metrics(pb_utils, self.model, stages=list(self.config.stages))
        self.tasks: set[asyncio.Task] = set()
        self.loop = asyncio.new_event_loop()
        self.responder = Responder(pb_utils, self.lock, self.metrics, self.output_dtypes,
                                   self.config.max_inflight_requests, self.log)
        self.subrequests = SubRequests(
            pb_utils, self.lock, self.loop, self.metrics, self.config, self.pass_through,
            self.model, max_rows=repository.stage_max_batch(repositories, self.config.stages),
            # Every instance of this model shares it (their stub processes serve one directory).
            lock_key=str(Path(args["model_repository"]).resolve()))
        self.log(f"orchestrating '{self.definition.name}': " + ", ".join(
            f"{s.name} -> {s.model} (as {self.contracts[s.name].name})"
            + (f" (timeout {s.timeout_ms} ms)" if s.timeout_ms else "")
            for s in self.config.stages.values())
            + f"; default deadline {self.config.default_deadline_ms} ms, "
            f"{self.config.concurrency_mode}"
            + (f", coalescing {', '.join(self.subrequests.coalescers) or 'no stage'} "
               f"({self.config.coalesce_in_flight} in flight per stage)"
               if self.config.coalesce else "")
            + "".join(f", {name} {value}" for name, value in self.config.options.items()))
        if self.config.gpu_tensors:
            kept = [f"{stage}'s {', '.join(names)}" for stage, names in self.pass_through.items()]
            copied = [stage for stage in self.definition.pass_through
                      if stage not in self.pass_through]
            self.log("gpu_tensors on: " + (f"kept on the GPU: {'; '.join(kept)}" if kept else
                                            "nothing kept on the GPU")
                     + (f"; copied to CPU (stage model not KIND_GPU): {', '.join(copied)}"
                        if copied else ""))
        # Last: every pb_utils call of initialize is made before a second thread exists.
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"{self.model}-loop",
                                       daemon=True)
        self.loop.call_soon(self._flush_metrics)
        self.thread.start()

    # -- execute (the stub's main thread) ---------------------------------------------------
    def execute(self, requests) -> None:
        started = []
        for request in requests:
            waited = self.responder.admit()  # backpressure: wait here, outside the lock
            with self.lock:
                sender = request.get_response_sender()
                try:
                    job = self._job(request, sender)
                    # Triton's dynamic batcher drops cancelled requests as it hands a batch to
                    # execute (core r24.10 dynamic_batch_scheduler.cc): unless this one waited
                    # for a slot, its first stage need not ask again (subrequests.cancelled).
                    job.cancelled = None if waited else False
                    self.responder.started()
                except Exception as error:  # noqa: BLE001 - this request fails alone
                    job = None
                    self.log(f"could not read request '{request.request_id()}': {error}", error=True)
                    self.responder.refuse(sender, f"could not read the request: {error}")
                del sender
            if job is None:
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
        with self.lock:
            self.metrics.increment("bls_inflight_requests", +1)
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
        self.responder.send(job, outputs, error)

    async def _run(self, job: Job) -> dict[str, np.ndarray]:
        return await self.run(job.inputs, functools.partial(self.subrequests.call, job),
                              self.setup)

    # -- metrics and logging ------------------------------------------------------------------------
    def _flush_metrics(self, histograms_due: float = 0.0) -> None:
        """Publish pending counter/gauge increments (and, every HISTOGRAM_FLUSH_SECONDS, the
        histograms' observations), then again in FLUSH_SECONDS."""
        now = self.loop.time()
        histograms = now >= histograms_due
        with self.lock:
            self.metrics.flush(histograms=histograms)
        self.loop.call_later(FLUSH_SECONDS, self._flush_metrics,
                             now + HISTOGRAM_FLUSH_SECONDS if histograms else histograms_due)

    def log(self, message: str, error: bool = False) -> None:
        logger = self.pb.Logger
        with self.lock:
            (logger.log_error if error else logger.log_info)(f"[{self.model}] {message}")

    # -- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain in-flight requests (bounded), answer the rest with UNAVAILABLE, stop threads."""
        remaining = self.responder.drain(SHUTDOWN_DRAIN_SECONDS)
        if remaining:
            self.log(f"cancelling {remaining} request(s) still in flight at shutdown")
            cancel = asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop)
            cancel.result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.subrequests.shutdown()
        with self.lock:
            self.metrics.close()

    async def _cancel_all(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for coalescer in self.subrequests.coalescers.values():
            await coalescer.close()


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
