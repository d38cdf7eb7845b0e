"""Runs a pipeline inside a Triton python-backend model: the wiring of the runtime.

The runtime is three parts, and only they use ``pb_utils``:

* this module: ``execute`` (turns requests into jobs), the event loop on its own thread that
  runs each job's pipeline, metrics flushing, shutdown, and ``python_model`` (a model.py's class);
* ``subrequests.SubRequests``: the sub-request wrapper a pipeline calls (deadline, abandonment,
  device-tensor lifetime);
* ``responder.Responder``: exactly one answer per request, whatever raises; admission with
  deadlines; the requests pending.

**The invariant.** Every request that reaches ``execute`` gets exactly one final response,
whatever raises — in any pb_utils call, in the run function, in the coalescer, at shutdown —
and ``execute`` itself never raises (in r24.10 an exception out of ``execute`` makes the backend
delete the response factory of every request in the batch, answered ones included:
``python_be.cc``). Failures of the orchestrator's own code are answered INTERNAL with a short
message naming the stage; the details go to the log only.

Design (docs/orchestrator.md has the measurements behind it):

* **Concurrency.** In Triton 2.51 a non-decoupled model's ``execute`` — async or not — is not
  re-entered until it returns, so a request waiting on a slow sub-model would hold up every
  request behind it. Here ``execute`` only takes each request's inputs, deadline and response
  sender, hands the request to an event loop this object owns (on its own thread), and returns
  once the answers of its batch are ready or ``return_within_ms`` has passed, whichever is
  first. The answers ready by then are returned from ``execute`` (r24.10 sends them to the
  server in one message; each ``send`` is a round trip of its own); every other request is
  answered later, exactly once, through its response sender, so a slow request holds its
  instance for ``return_within_ms`` at most. Plain unary HTTP and gRPC clients work unchanged
  (the model is not decoupled).
* **Groups.** The requests that get a slot together — the requests of one ``execute`` batch, as
  Triton's dynamic batcher formed it, as a rule — run as one group when they share a deadline,
  input shapes and dtypes and requested outputs (``responder.group_key``), up to ``group_rows``
  rows (this model's ``max_batch_size``, and no more than every stage model takes): one task, one
  run of the pipeline on their stacked rows, one sub-request per stage; each member is answered
  from its own rows. Each keeps its semantics: its deadline (a group's members share it), its
  cancellation (a cancelled member is answered at once; its rows go on with the group's),
  exactly one answer, its request id (a group's sub-requests carry its members' ids,
  comma-separated), its metrics. A failure one item may cause — a bad input (``Kind.INVALID``,
  the run function's ``InvalidInput`` or a sub-model's), a bug of the run function — re-runs each
  member alone, once, within an isolation budget; a failure of a stage as a whole does not.
* **Sub-requests.** ``InferenceRequest.exec`` blocks its thread until the sub-model answers, so
  each in-flight sub-request runs on a thread of a dedicated pool (``subrequest_threads``,
  instead of asyncio's default executor of ``min(32, cores + 4)`` threads).
* **The pb_utils lock.** Using ``pb_utils`` from several threads at once crashed stubs under
  bursts on this build. Python objects that wrap backend memory (tensors, requests, responses)
  are created and destroyed under ``self.lock``, and so are the local reads of requests and
  sub-responses. Round trips to the server are made with no lock held: ``exec`` (holding it
  would serialise sub-requests), ``send``, ``is_cancelled`` and metric publication (holding it
  stalled every sub-request thread behind one IPC). A started request's response sender is used
  by the event loop's thread only, so no lock is needed to keep ``is_cancelled`` from meeting a
  closed sender. A sub-response's outputs are turned into numpy arrays the stub owns (the python
  backend's own copies, or reduced from them as the tagger's 28.7 MB logits are) on the
  sub-request's thread while the response is still alive, so nothing that points into shared
  memory outlives its owner.
* **Deadlines** count from the request's arrival in ``execute``, before any wait for a slot
  (r24.10 tells a model nothing of the time a request spent in Triton's own queue before
  ``execute``; the queue policy applies the client's timeout there). Each sub-request gets the
  request's remaining budget (capped by its stage's timeout) twice: as its Triton ``timeout``,
  computed when a thread actually sends it (so the sub-model's queue drops it), and as a limit on
  the wait here (so a sub-request that is already running cannot hold the request). A
  sub-request given up on keeps its thread until the sub-model answers (r24.10 cannot cancel
  it); it is counted as abandoned and its result dropped. One whose deadline passed before a
  thread picked it up is never sent.
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
* **Admission.** At most ``max_inflight_requests`` requests per instance run at once; up to
  ``max_queued_requests`` more wait in the runtime for a slot, each answered when its deadline
  passes; beyond those ``execute`` waits (again at most until a deadline), so further requests
  stay in Triton's bounded queue of this model (``responder.Responder``).
* **Shutdown** (``finalize``) drains what is in flight (bounded), cancels the rest, stops the
  event loop and the sub-request threads (bounded) and publishes the metrics on every path,
  answers every request still pending, and makes sure no pb_utils call happens after it returns.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from bls_models import params, repository
from bls_models import spec as S
from bls_models.coalescing import IsolationBudget
from bls_models.deadline import Deadline
from bls_models.definition import PipelineDef, Setup, registered
from bls_models.errors import Code, InvalidInput, Kind, PipelineError, internal_error
from bls_models.metrics import FLUSH_SECONDS, HISTOGRAM_FLUSH_SECONDS, Metrics
from bls_models.responder import Job, Responder, group, group_key, rows_of
from bls_models.subrequests import SubRequests

_NUMPY = {name: np.dtype(dtype) for name, dtype in S.DTYPES.items()}
SHUTDOWN_DRAIN_SECONDS = 10.0   # finalize waits this long for requests in flight
SHUTDOWN_CANCEL_SECONDS = 5.0   # then for their cancellation
SHUTDOWN_LOOP_SECONDS = 10.0    # then for the event loop to stop (its round trips to return)
SHUTDOWN_THREADS_SECONDS = 1.0  # then for sub-requests still out (a thread per sub-request)
GATHER_SLACK_SECONDS = 1.0      # batch_gather: execute answers a job itself this long after its
                                # deadline (the event loop answers it by then, as a rule)


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
        # A decoupled model's execute must return None (r24.10 pb_stub.cc): every answer is sent.
        self.decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled"))
        self.hold = 0.0 if self.decoupled else self.config.return_within_ms / 1e3
        # execute waits for its batch's answers: for return_within_ms, or (batch_gather) all.
        self.gather = self.config.concurrency_mode == "batch_gather"
        self.waits = self.gather or self.hold > 0
        # The most rows run as one group: this model's batch, and what every stage takes.
        stage_rows = repository.stage_max_batch(repositories, self.config.stages)
        self.group_rows = min([max(1, int(config.get("max_batch_size", 0)))]
                              + [rows for rows in stage_rows.values() if rows > 0])
        # Re-runs of a failed group's members, one by one (``_answer_members``).
        self.isolation = IsolationBudget(self.group_rows)
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
        # Set under the lock as finalize ends: no pb_utils call any more, from any thread.
        self.finalized = threading.Event()
        self.metrics = Metrics(pb_utils, self.model, stages=list(self.config.stages))
        self.metrics_failing = False
        self.tasks: set[asyncio.Task] = set()
        self.cancelling = False  # shutdown cancels what runs (event loop only)
        self.loop = asyncio.new_event_loop()
        self.responder = Responder(pb_utils, self.lock, self.metrics, self.output_dtypes,
                                   self.config.max_inflight_requests, self.model, self.log,
                                   self.finalized, self.config.max_queued_requests)
        self.subrequests = SubRequests(
            pb_utils, self.lock, self.loop, self.metrics, self.config, self.pass_through,
            self.model, self.log, self.finalized,
            max_rows=stage_rows,
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
    def execute(self, requests):
        """Take every request of the batch, admit each (waiting for a slot at most until its
        deadline) and hand it to the event loop. Never raises: a request that cannot be read
        or run is answered here; one whose response sender cannot be had is answered through
        the list returned (``None`` when there is none, the usual case)."""
        arrived = time.monotonic()
        jobs: list[Job] = []
        try:
            for request in requests:
                jobs.append(self._receive(request, arrived))
            ready = []
            for job in jobs:
                if job.failure is None:
                    ready.append(job)
                else:
                    self.responder.answer(job, error=job.failure)
            if self.waits:  # execute waits for its batch's answers and returns them
                for job in ready:
                    job.done, job.by_return = threading.Event(), not self.decoupled
            self.responder.admit(ready, self._start)
            if self.waits:
                self._gather(ready, None if self.gather else arrived + self.hold)
        except BaseException:  # noqa: BLE001 - execute must not raise (see the module docstring)
            self.log(f"execute failed:\n{traceback.format_exc()}", error=True)
            jobs += [Job(Deadline.for_request(0, 0, arrived), arrived, by_return=True)
                     for _ in requests[len(jobs):]]
            for job in jobs:
                if not job.started:
                    self.responder.answer(job, error=internal_error(self.model))
            if any(job.by_return and job.started for job in jobs):
                self._gather([job for job in jobs if job.by_return and job.started], arrived)
        returned = [job.returned for job in jobs]
        return returned if any(response is not None for response in returned) else None

    def _gather(self, jobs: list[Job], until: float | None) -> None:
        """Wait for the answers of ``jobs`` (started with ``by_return``) until ``until``
        (``time.monotonic``); those answered by then are in ``job.returned``, for ``execute`` to
        return, and the others are answered through their senders when they finish
        (``Responder.to_senders``). ``until`` None (batch_gather): wait for every answer; the
        event loop gives each by its deadline, and should it not, within
        ``GATHER_SLACK_SECONDS`` more, the job is answered here. Never raises."""
        try:
            for job in jobs:
                end = until if until is not None else (job.deadline.end + GATHER_SLACK_SECONDS)
                if not job.done.wait(max(0.0, end - time.monotonic())) and until is None:
                    self.responder.answer(job, error=PipelineError(
                        Code.UNAVAILABLE, f"model '{self.model}' did not answer within the "
                        "request's deadline", kind=Kind.DEADLINE))
            # An answer claimed before the lock decided is being built: it comes at once.
            for job in self.responder.to_senders(jobs):
                if not job.done.wait(SHUTDOWN_LOOP_SECONDS):
                    self.log(f"the answer of '{job.request_id}' did not come", error=True)
        except BaseException:  # noqa: BLE001 - execute must not raise
            self.log(f"waiting for answers failed:\n{traceback.format_exc()}", error=True)

    def _receive(self, request, arrived: float) -> Job:
        """A job for ``request``; never raises. What cannot be read makes it a failed job
        (answered at once), its reason logged."""
        job = Job(Deadline.for_request(0, self.config.default_deadline_ms, arrived), arrived)
        with self.lock:
            try:
                job.sender = request.get_response_sender()
            except Exception:  # noqa: BLE001 - answered through execute's return value
                self.log(f"could not get a response sender:\n{traceback.format_exc()}",
                         error=True)
                job.by_return = True
                job.failure = internal_error(self.model)
            try:
                job.request_id = request.request_id()
            except Exception:  # noqa: BLE001 - the request goes on without its id
                self.log(f"could not read a request id:\n{traceback.format_exc()}", error=True)
            try:
                job.deadline = Deadline.for_request(int(request.timeout()),
                                                    self.config.default_deadline_ms, arrived)
            except Exception:  # noqa: BLE001 - the default deadline applies
                self.log(f"could not read the timeout of '{job.request_id}':\n"
                         f"{traceback.format_exc()}", error=True)
            if job.failure is not None:
                return job
            try:
                for name in self.input_names:
                    tensor = self.pb.get_input_tensor_by_name(request, name)
                    if tensor is None:
                        job.failure = InvalidInput(f"the request has no input '{name}'")
                        return job
                    # A copy: nothing of the request's memory is used after execute returns.
                    job.inputs[name] = np.array(tensor.as_numpy(), copy=True)
                    del tensor
                job.rows = len(next(iter(job.inputs.values())))
                job.outputs = [n for n in request.requested_output_names()
                               if n in self.output_dtypes] or list(self.output_dtypes)
            except Exception:  # noqa: BLE001 - core validated the request: this is not its fault
                self.log(f"could not read request '{job.request_id}':\n{traceback.format_exc()}",
                         error=True)
                job.failure = internal_error(self.model)
        # Not request.trace(): the request (and its trace) is released when execute returns,
        # and a sub-request spawned from that trace later segfaults Triton 2.51 when tracing is
        # on (verified). Sub-requests carry the request id instead.
        return job

    def _start(self, jobs: list[Job]) -> None:
        """Hand admitted jobs to the event loop in one call (their tasks start in the same loop
        turn, so their first sub-requests can go as one group); from then on the loop owns
        their senders."""
        for job in jobs:
            job.started = True
        try:
            self.loop.call_soon_threadsafe(self.responder.enter, jobs, self._run, self.loop)
        except Exception:  # noqa: BLE001 - the loop is closed: the model is unloading
            for job in jobs:
                job.started = False
                self.responder.answer(job, error=self._shutting_down())

    def _run(self, jobs: list[Job]) -> None:
        """Jobs got slots (event loop): those that can go together (``responder.group_key``:
        the requests of one ``execute`` batch, as a rule) run as groups of at most
        ``group_rows`` rows, one task per group. Once shutdown cancels what is running, they
        are answered instead of started."""
        if self.cancelling:
            for job in jobs:
                self.responder.answer(job, error=self._shutting_down())
            self.responder.leave(jobs, None)  # no hand-over: shutdown answers the others
            return
        handed: set[int] = set()

        def start(members: list[Job]) -> None:
            job = group(members)
            if job.members is not None:
                job.drop = self._drop
            self.loop.create_task(self._answer(job))
            handed.update(id(member) for member in members)

        try:
            groups: dict[tuple, tuple[list[Job], int]] = {}  # key -> (members, their rows)
            for job in jobs:
                key = group_key(job)
                members, rows = groups.get(key, ([], 0))
                if members and rows + job.rows > self.group_rows:
                    start(members)
                    members, rows = [], 0
                groups[key] = (members + [job], rows + job.rows)
            for members, _ in groups.values():
                start(members)
        except Exception:  # noqa: BLE001 - e.g. stacking the rows failed: the rest go alone
            self.log(f"grouping requests failed:\n{traceback.format_exc()}", error=True)
            for job in jobs:
                if id(job) not in handed:
                    self.loop.create_task(self._answer(job))

    def _shutting_down(self) -> PipelineError:
        return PipelineError(Code.UNAVAILABLE, f"model '{self.model}' is shutting down")

    # -- one request (the event loop's thread) -------------------------------------------------
    async def _answer(self, job: Job) -> None:
        """Run the pipeline for ``job`` (a request, or a group of them) and answer it; a group's
        members are answered by ``_answer_members``."""
        task = asyncio.current_task()
        self.tasks.add(task)
        outputs = error = None
        bug = False
        try:
            outputs = await self.run(job.inputs, functools.partial(self.subrequests.call, job),
                                     self.setup)
        except PipelineError as failure:
            error = failure
        except asyncio.CancelledError:
            error = self._shutting_down()
        except Exception:  # noqa: BLE001 - a bug here must not take the request's answer with it
            self.log(f"request '{job.request_id}' failed:\n{traceback.format_exc()}", error=True)
            error, bug = internal_error(self.model), True
        finally:
            self.tasks.discard(task)
            if job.members is None:
                self.responder.answer(job, outputs, error)
                self.responder.leave([job], self._run)
            else:
                self._answer_members(job, outputs, error, bug)

    def _drop(self, member: Job, error: PipelineError) -> None:
        """A member leaves its group early (cancelled): answered now, its slot handed on."""
        self.responder.answer(member, error=error)
        self.responder.leave([member], self._run)

    def _answer_members(self, job: Job, outputs: dict | None, error: PipelineError | None,
                        bug: bool) -> None:
        """Answer a group's members from their rows of ``outputs``, or with ``error``. When one
        member may have caused the failure — a bad input (``Kind.INVALID``), or a bug of the run
        function (it raised, or its outputs do not have the group's rows) — each member runs
        alone, once, so only the culprit hears of it, while the isolation budget allows (one
        group in reserve, half a re-run earned per member answered from a successful group: a
        pipeline failing every group re-runs nothing once the reserve is spent; its members
        then get the group's error). Not when a sub-request of the group failed for a reason
        no item causes (``Job.stage_failure``): every member then hears that failure. Never
        raises."""
        live = job.live()
        alone = []
        try:
            if error is None:
                try:
                    rows = rows_of(outputs, job.members, job.rows, job.outputs)
                except Exception:  # noqa: BLE001 - the run function's outputs are malformed
                    self.log(f"the outputs of group '{job.request_id}' could not be split:\n"
                             f"{traceback.format_exc()}", error=True)
                    error, bug = internal_error(self.model), True
                else:
                    for member, member_outputs in zip(job.members, rows):
                        self.responder.answer(member, member_outputs)
                    self.isolation.earn(len(live))
            if error is not None:
                if ((bug or error.kind is Kind.INVALID) and job.stage_failure is None
                        and len(live) > 1 and not self.cancelling
                        and self.isolation.spend(len(live))):
                    alone = live
                else:
                    if error.kind is Kind.INVALID and job.stage_failure is not None:
                        error = job.stage_failure  # an innocent member was not the cause
                    for member in live:
                        self.responder.answer(member, error=error)
        except Exception:  # noqa: BLE001 - answer never raises; this is the last resort
            self.log(f"answering group '{job.request_id}' failed:\n{traceback.format_exc()}",
                     error=True)
            alone = []
            for member in live:
                self.responder.answer(member, error=internal_error(self.model))
        finally:
            self.responder.release(job)
            for member in alone:  # each keeps its slot
                self.loop.create_task(self._answer(member))
            self.responder.leave([m for m in live if m.answered], self._run)

    # -- metrics and logging ------------------------------------------------------------------------
    def _flush_metrics(self, histograms_due: float = 0.0) -> None:
        """Publish pending counter/gauge increments (and, every HISTOGRAM_FLUSH_SECONDS, the
        histograms' observations), then again in FLUSH_SECONDS, whatever happens. A publication
        that fails keeps what it did not publish for the next one (``Metrics.flush``)."""
        if self.finalized.is_set():
            return
        now = self.loop.time()
        histograms = now >= histograms_due
        try:
            self.metrics.flush(histograms=histograms)
            if self.metrics_failing:
                self.metrics_failing = False
                self.log("publishing metrics works again")
        except Exception:  # noqa: BLE001 - logged when it starts failing, not every time
            if not self.metrics_failing:
                self.metrics_failing = True
                self.log(f"publishing metrics failed (retried every {FLUSH_SECONDS} s):\n"
                         f"{traceback.format_exc()}", error=True)
        finally:
            self.loop.call_later(FLUSH_SECONDS, self._flush_metrics,
                                 now + HISTOGRAM_FLUSH_SECONDS if histograms else histograms_due)

    def log(self, message: str, error: bool = False) -> None:
        """Log through Triton (no-op once finalized). Never raises: logging must not take a
        request's answer with it."""
        try:
            with self.lock:
                if not self.finalized.is_set():
                    logger = self.pb.Logger
                    (logger.log_error if error else logger.log_info)(f"[{self.model}] {message}")
        except Exception:  # noqa: BLE001 - the stub's stderr is the last resort
            try:
                print(f"[{self.model}] {message}", file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001
                pass

    # -- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain in-flight requests (bounded), cancel the rest, stop the loop and the threads,
        answer whatever is still pending with UNAVAILABLE, publish the metrics; every step on
        every path, each bounded. No pb_utils call happens after it returns. Never raises."""
        try:
            remaining = self.responder.drain(SHUTDOWN_DRAIN_SECONDS)
            if remaining:
                self.log(f"cancelling {remaining} request(s) still in flight at shutdown")
                asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(
                    timeout=SHUTDOWN_CANCEL_SECONDS)
        except BaseException:  # noqa: BLE001 - the rest of the shutdown happens all the same
            self.log(f"cancelling at shutdown failed:\n{traceback.format_exc()}", error=True)
        finally:
            self._stop()

    def _stop(self) -> None:
        stopped = False
        try:
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # already closed
                pass
            self.thread.join(timeout=SHUTDOWN_LOOP_SECONDS)
            stopped = not self.thread.is_alive()
            stuck = self.subrequests.close(SHUTDOWN_THREADS_SECONDS)
            if stuck:
                self.log(f"{stuck} sub-request(s) still out at shutdown: their threads are left "
                         "to the process's exit and make no further pb_utils call", error=True)
            if stopped:  # this thread owns every sender now
                left = self.responder.answer_all(self._shutting_down())
                if left:
                    self.log(f"answered {left} request(s) the event loop left at shutdown")
                self.loop.close()
            else:
                self.log("the event loop did not stop; its requests stay unanswered", error=True)
        except BaseException:  # noqa: BLE001
            self.log(f"shutdown failed:\n{traceback.format_exc()}", error=True)
        finally:
            try:
                self.metrics.close()
            except BaseException:  # noqa: BLE001
                self.log(f"publishing the last metrics failed:\n{traceback.format_exc()}",
                         error=True)
            with self.lock:
                self.finalized.set()

    async def _cancel_all(self) -> None:
        self.cancelling = True
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
