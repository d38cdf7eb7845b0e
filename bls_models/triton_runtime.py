"""Runs a pipeline inside a Triton python-backend model: ``execute``, its groups, shutdown.

The normal path is the plainest per-batch BLS: ``execute`` reads each request and runs the
pipeline's per-request check, stacks the batch into groups, hands each group to a worker that
steps the run function (``flow``) and sends one sub-request per stage (``subrequests``), and
returns every answer once the batch is done (``answers``). What handles the abnormal sits beside
it: a batch slower than the hold (``params.HOLD_FACTOR`` times the recent batches' time, at most
``return_within_ms``) goes on with its answers sent, its deadlines kept by the clock and its
cancellations checked before each stage; a failure one request may cause re-runs the members
alone (``isolation``); ``admission`` bounds what runs. Every request that reaches ``execute``
gets exactly one final response, whatever raises, and ``execute`` never raises.
docs/orchestrator.md follows one request through it.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from pathlib import Path

import numpy as np

from bls_models import flow, params, repository
from bls_models import group as groups
from bls_models import spec as S
from bls_models.admission import Admission
from bls_models.answers import Answers, Batch, Job
from bls_models.backend import Backend, DeviceTensor
from bls_models.clock import Clock
from bls_models.deadline import Deadline
from bls_models.definition import PipelineDef, Setup, registered
from bls_models.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidInput,
    Kind,
    PipelineError,
    SlotWaitExpired,
    internal_error,
)
from bls_models.isolation import (
    BACKLOG_GROUPS,
    RESERVE_GROUPS,
    Budget,
    Exclusive,
    Memo,
    backlog_full,
    isolatable,
)
from bls_models.metrics import ADMISSION, FLUSH_SECONDS, HISTOGRAM_FLUSH_SECONDS, Metrics
from bls_models.subrequests import SubRequests, shutting_down
from bls_models.workers import Workers

_NUMPY = {name: np.dtype(dtype) for name, dtype in S.DTYPES.items()}
ANSWER_BUILT_SECONDS = 10.0     # execute waits this long at most for an answer being built
SHUTDOWN_DRAIN_SECONDS = 10.0   # finalize waits this long for the sub-requests out to finish
SHUTDOWN_THREADS_SECONDS = 1.0  # then for the threads (one may be stuck in a sub-model)
HOLD_WINDOW = 64                # recent batches the hold is computed from


class Hold:
    """How long ``execute`` waits for a batch's answers: ``params.HOLD_FACTOR`` times the time a
    batch of its rows is expected to take — the recent batches' median time, or their median time
    per row times its rows if that is longer (a batch of 8 rows over CPU models takes several
    times a batch of 1) — at least ``HOLD_FLOOR_MS``, at most ``return_within_ms``."""

    def __init__(self, cap_ms: int) -> None:
        self.cap = cap_ms / 1e3
        self.durations: deque[float] = deque(maxlen=HOLD_WINDOW)
        self.per_row: deque[float] = deque(maxlen=HOLD_WINDOW)
        self.median: float | None = None
        self.median_per_row = 0.0
        self._seen = 0

    def observe(self, seconds: float, rows: int) -> None:
        self.durations.append(seconds)
        self.per_row.append(seconds / max(rows, 1))
        self._seen += 1
        if self._seen % 8 == 0:
            self.median = sorted(self.durations)[len(self.durations) // 2]
            self.median_per_row = sorted(self.per_row)[len(self.per_row) // 2]

    def seconds(self, rows: int) -> float:
        if self.median is None:
            return min(self.cap, params.FIRST_HOLD_MS / 1e3)
        expected = max(self.median, self.median_per_row * rows)
        return min(self.cap, max(params.HOLD_FLOOR_MS / 1e3, params.HOLD_FACTOR * expected))


class Orchestrator:
    def __init__(self, pb_utils, args: dict, pipeline: PipelineDef | str) -> None:
        self.model = args["model_name"]
        config = json.loads(args["model_config"])
        self.backend = Backend(pb_utils, self.model)
        self.definition = pipeline if isinstance(pipeline, PipelineDef) else registered(pipeline)
        if (config.get("model_transaction_policy") or {}).get("decoupled"):
            raise params.ConfigError(f"orchestrator '{self.model}' answers one response per "
                                     "request: remove model_transaction_policy { decoupled }")
        self.config = self.definition.parse(params.string_parameters(config))
        # This model's own repository first (the parent of its directory), then any others.
        repositories = [Path(args["model_repository"]).parent,
                        *(Path(p) for p in self.config.stage_model_repositories)]
        # Which contract each stage model meets decides, e.g., whether the tagger reduces.
        contracts, problems = repository.resolve_stages(repositories, self.config.stages,
                                                        self.definition.contracts)
        if problems:
            raise params.ConfigError("; ".join(problems))
        self.run = self.definition.run_function()
        self.check = self.definition.check_function()
        # The most rows one sub-request to each stage may hold (0: the stage does not batch).
        stage_rows = repository.stage_max_batch(repositories, self.config.stages)
        self.setup = Setup(options=self.config.options, contracts=contracts,
                           max_rows={stage: max(rows, 1) for stage, rows in stage_rows.items()})
        self.batching = frozenset(stage for stage, rows in stage_rows.items() if rows > 0)
        self.input_names = [t["name"] for t in config["input"]]
        self.output_dtypes = {t["name"]: _NUMPY[t["data_type"]] for t in config["output"]}
        self.first_stage = self.definition.stages[0].name
        # The most rows run as one group: this model's batch, and what every stage takes.
        self.group_rows = min([max(1, int(config.get("max_batch_size", 0)))]
                              + [rows for rows in stage_rows.values() if rows > 0])
        # gpu_tensors: a stage's pass-through outputs stay on the GPU only if its model is
        # configured KIND_GPU. Asking a CPU instance for GPU output memory fails the sub-request
        # ("BackendMemory::Create, all allocation types failed"), so other stages keep the copy.
        kinds = repository.stage_kinds(repositories, self.config.stages)
        self.pass_through = {
            stage: names for stage, names in self.definition.pass_through.items()
            if self.config.gpu_tensors and kinds.get(stage) == {"KIND_GPU"}}

        self.log = self.backend.log
        self.metrics = Metrics(self.backend, self.model, stages=list(self.config.stages))
        self.metrics_failing = False
        self.subrequests = SubRequests(self.backend, self.config, self.metrics, self.pass_through,
                                       self.model, self.log)
        self.answers = Answers(self.backend, self.metrics, self.output_dtypes, self.model,
                               self.log, self._answered)
        self.admission = Admission(self.config.max_inflight_requests,
                                   self.config.max_queued_requests)
        self.hold = Hold(self.config.return_within_ms)
        self.budget = Budget(RESERVE_GROUPS * self.group_rows)
        # Every instance of this model shares it (their stub processes serve one directory).
        self.exclusive = Exclusive(f"{Path(args['model_repository']).resolve()}\0{self.model}")
        self.log(f"orchestrating '{self.definition.name}': " + ", ".join(
            f"{s.name} -> {s.model} (as {contracts[s.name].name})"
            + (f" (timeout {s.timeout_ms} ms)" if s.timeout_ms else "")
            for s in self.config.stages.values())
            + f"; default deadline {self.config.default_deadline_ms} ms, groups of up to "
            f"{self.group_rows} rows, execute waits up to {self.config.return_within_ms} ms"
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
        self.workers = Workers(self.config.subrequest_threads, f"{self.model}-worker", self.log)
        # Isolations run one at a time anyway (``exclusive``): on a thread of their own, so a
        # failed group waiting for its turn holds no worker, and at most BACKLOG_GROUPS wait.
        self.isolator = Workers(1, f"{self.model}-isolation", self.log)
        self.isolations = 0
        self._isolations_lock = threading.Lock()
        self.clock = Clock(self.model, self.log)
        self.clock.at(time.monotonic() + FLUSH_SECONDS, self._flush_metrics, 0.0)

    # -- execute (the stub's main thread) ---------------------------------------------------
    def execute(self, requests):
        """Answer the batch: read and check each request, run the batch as groups, and return
        the answers once it is done; what is not done within the hold is answered later through
        response senders. Never raises."""
        arrived = time.monotonic()
        batch = Batch()
        jobs: list[Job] = []
        try:
            for request in requests:
                jobs.append(self._receive(request, arrived, batch))
            ready = [job for job in jobs if not job.answered]
            self.answers.received(batch, ready)
            if ready:
                queued = self.admission.take(ready, self._start, self._expire)
                self._detach(queued)  # no answer can come before a slot does
                # At capacity, requests wait behind this batch: execute must not hold them.
                hold = (0.0 if self.admission.full()
                        else self.hold.seconds(sum(job.rows for job in ready)))
                self._wait(batch, ready, arrived + hold)
        except BaseException:  # noqa: BLE001 - execute must not raise (python_be.cc deletes every factory)
            self.log(f"execute failed:\n{traceback.format_exc()}", error=True)
            for request in requests[len(jobs):]:
                job = Job(request, Deadline.for_request(0, 0, arrived), arrived, batch)
                batch.waiting += 1
                jobs.append(job)
                self.answers.answer(job, error=internal_error(self.model))
            self.answers.received(batch, [])
            self._detach(jobs)
        if not batch.wait(ANSWER_BUILT_SECONDS):
            self.log("an answer being built did not come", error=True)
        returned = []
        for job in jobs:
            job.request = None
            returned.append(None if job.held is None else self.backend.take(job.held))
            job.held = None
        return returned if any(response is not None for response in returned) else None

    def _receive(self, request, arrived: float, batch: Batch) -> Job:
        """A job for ``request``, answered at once if it cannot run; never raises."""
        job = Job(request, None, arrived, batch)
        batch.waiting += 1
        got = self.backend.read(request, self.input_names, self.log)
        job.request_id = got.request_id
        job.deadline = Deadline.for_request(got.timeout_us or 0, self.config.default_deadline_ms,
                                            arrived, self.config.max_deadline_ms)
        if got.failure is not None:
            missing = got.failure.startswith("missing:")
            self.answers.answer(job, error=InvalidInput(
                f"the request has no input '{got.failure[len('missing:'):]}'") if missing
                else internal_error(self.model))
            return job
        job.inputs = got.inputs
        job.rows = len(next(iter(got.inputs.values())))
        job.outputs = (list(dict.fromkeys(n for n in got.outputs if n in self.output_dtypes))
                       or list(self.output_dtypes))
        if self.check is not None:
            try:
                self.check(job.inputs, self.setup)
            except PipelineError as error:
                self.answers.answer(job, error=error)
            except Exception:  # noqa: BLE001 - a bug of the check: INTERNAL, logged
                self.log(f"the check of '{job.request_id}' failed:\n{traceback.format_exc()}",
                         error=True)
                self.answers.answer(job, error=internal_error(self.model))
        return job

    def _wait(self, batch: Batch, jobs: list[Job], hold_end: float) -> None:
        """Wait for the answers of ``jobs`` until ``hold_end``; a job whose deadline passes
        meanwhile is answered then, through its sender (its answer must not wait for the
        batch). Then let the rest go to their senders."""
        while not batch.done:
            now = time.monotonic()
            live = [job for job in jobs if not job.answered and job.returning]
            if not live or now >= hold_end:
                break
            earliest = min(job.deadline.end for job in live)
            if earliest <= now:
                self._detach([job for job in live if job.deadline.end <= now])
                continue
            batch.wait(min(hold_end, earliest) - now)
        self._detach(jobs)

    def _detach(self, jobs: list[Job]) -> None:
        """``execute`` stops waiting for ``jobs``: those not answered yet go to their response
        senders (their deadlines to the clock, their groups to cancellation checks); one whose
        sender cannot be had is answered INTERNAL now."""
        late = [job for job in jobs if not job.answered and job.returning]
        if late:
            for job in late:
                try:
                    job.sender = self.backend.sender(job.request)
                except Exception:  # noqa: BLE001 - it is answered through execute's list instead
                    self.log(f"could not get the response sender of '{job.request_id}':\n"
                             f"{traceback.format_exc()}", error=True)
            detached = self.answers.detach(late)
            self.metrics.increment("bls_detached_requests_total", len(detached))
            now = time.monotonic()
            for job in detached:
                if job.group is not None:
                    job.group.detached = True
                if job.deadline.end <= now:
                    self._deadline(job)
                else:
                    job.timer = self.clock.at(job.deadline.end, self._deadline, job)
            for job in late:
                if job.sender is None:
                    self.answers.answer(job, error=internal_error(self.model))

    # -- slots and deadlines ------------------------------------------------------------------
    def _start(self, jobs: list[Job], waited: bool = False) -> None:
        """Jobs got slots (at once, or after waiting in the queue): their groups go to the
        workers (a job answered meanwhile, at its deadline, is not started)."""
        jobs = [job for job in jobs if not job.answered]
        try:
            formed = groups.form(jobs, self.group_rows, self.first_stage)
        except Exception:  # noqa: BLE001 - e.g. stacking the rows failed: the orchestrator's bug
            self.log(f"grouping requests failed:\n{traceback.format_exc()}", error=True)
            for job in jobs:
                self.answers.answer(job, error=internal_error(self.model))
            return
        for group in formed:
            for member in group.members:
                member.group = group
            group.detached = any(not member.returning for member in group.members)
            group.asked = not waited
            try:
                self.workers.submit(self._run, group)
            except Exception:  # noqa: BLE001 - shut down: the model is unloading
                for member in group.members:
                    self.answers.answer(member, error=shutting_down(self.model))
                self._end(group)

    def _answered(self, jobs: list[Job]) -> None:
        """Jobs were answered: their timers go, their slots to the next queued jobs — once
        their group has ended (a member answered at its deadline keeps its slot while its
        group's sub-requests are still out: the slots bound the work, not only the waiting).
        Never raises."""
        try:
            for job in jobs:
                if job.timer is not None:
                    job.timer.cancel()
                    job.timer = None
            self._release([job for job in jobs if job.group is None or job.group.ended])
        except Exception:  # noqa: BLE001 - an answer must not fail on what follows it
            self.log(f"handing on slots failed:\n{traceback.format_exc()}", error=True)

    def _end(self, group) -> None:
        """``group`` does no more work (its flow is over and nothing of it is out): its
        members' slots go to the next queued jobs. Never raises."""
        try:
            with group.lock:
                if group.ended:
                    return
                group.ended = True
            self._release(group.members)
        except Exception:  # noqa: BLE001 - never raises: logged, the slots stay handed
            self.log(f"handing on slots failed:\n{traceback.format_exc()}", error=True)

    def _release(self, jobs: list[Job]) -> None:
        try:
            following = self.admission.release(jobs)
            if following:
                self._start(following, waited=True)
        except Exception:  # noqa: BLE001 - an answer must not fail on what follows it
            self.log(f"handing on slots failed:\n{traceback.format_exc()}", error=True)

    def _expire(self, job: Job) -> None:
        """A job's deadline passed while ``execute`` waited for room."""
        self.metrics.increment("bls_deadline_exceeded_total", stage=ADMISSION)
        self.answers.answer(job, error=SlotWaitExpired(
            self.model, job.deadline.budget_ms, job.deadline.label,
            self.config.max_inflight_requests))

    def _deadline(self, job: Job) -> None:
        """``job``'s deadline passed (execute's thread, or the clock): answered UNAVAILABLE
        naming where it was; a group left with no one to answer for is abandoned."""
        if job.answered:
            return
        group = job.group
        if group is None or job.queued:
            self._expire(job)
            return
        stage = group.where()
        error = DeadlineExceeded(stage, self.config.stage(stage).model, job.deadline.budget_ms,
                                 job.deadline.label)
        if job.first("deadline"):
            self.metrics.increment("bls_deadline_exceeded_total", stage=stage)
        self.answers.answer(job, error=error)
        if not group.live():
            self._abandon(group, deadline=True)

    def _abandon(self, group, deadline: bool = False) -> None:
        """No member is left to answer for: the flow stops; what is out is dropped when it
        comes back (r24.10 cannot cancel a sub-request)."""
        with group.lock:
            if group.closed:
                return
            group.closed = True
            out = list(group.out)
            if group.flow is not None:
                group.flow.close()
        if not out:  # else the last one to come back ends it
            self._end(group)
        for sub in out:
            self.metrics.increment("bls_abandoned_subrequests_total", stage=sub.stage)
            if deadline:
                self.subrequests.count_error(sub.stage, Kind.DEADLINE)
        self._free(group)

    # -- a group (worker threads) ---------------------------------------------------------------
    def _run(self, group) -> None:
        group.started = time.monotonic()
        if group.closed:  # every member was answered while it waited for a worker
            self._end(group)
            return
        try:
            group.flow = flow.Flow(self.run(group.inputs, flow.SubRequest,
                                            self._setup(group)))
            with group.lock:
                waiting = [] if group.closed else group.flow.start()
                done = group.flow.done and not group.closed
                if done:
                    group.closed = True
        except Exception:  # noqa: BLE001 - the run function could not even start: a bug
            self.log(f"group '{group.ids}' could not start:\n{traceback.format_exc()}",
                     error=True)
            self._fail(group, internal_error(self.model))
            self._end(group)
            return
        if done:
            self._finish(group)
        else:
            self._drive(group, waiting)

    def _setup(self, group) -> Setup:
        """The run function's setup for ``group``: which outputs its rows asked for, when some
        asked for less than every output."""
        every = len(self.output_dtypes)
        if all(len(member.outputs) == every for member in group.members):
            return self.setup
        return replace(self.setup, asked=tuple((member.rows, frozenset(member.outputs))
                                               for member in group.members))

    def _drive(self, group, waiting: list) -> None:
        """Send what the flow waits for: one sub-request on this thread, the others on more
        workers; go on with whatever each one's outcome unblocks."""
        while waiting:
            if group.asked:  # the scheduler's answer holds for the first step
                group.asked = False
            elif group.detached and not self._still_wanted(group, waiting[0].stage):
                return
            sub, rest = waiting[0], waiting[1:]
            for other in rest:
                try:
                    self.workers.submit(self._send, group, other)
                except Exception:  # noqa: BLE001 - shut down: it fails like any sub-request
                    self._drive(group, self._resume(group, other, None,
                                                    shutting_down(self.model)))
            waiting = self._send_one(group, sub)

    def _send(self, group, sub) -> None:
        self._drive(group, self._send_one(group, sub))

    def _send_one(self, group, sub) -> list:
        with group.lock:  # abandoned meanwhile: not sent (the group has ended, or will)
            if group.closed:
                return []
            group.out[sub] = None
        timeout_ms = self.config.stage(sub.stage).timeout_ms
        timer = (self.clock.at(time.monotonic() + timeout_ms / 1e3, self._stage_timed_out,
                               group, sub) if timeout_ms else None)
        inputs = sub.inputs
        try:
            outputs, error = self.subrequests.send(group, sub)
            if outputs is not None and sub.stage in self.batching:
                group.done.append((sub.stage, inputs, outputs))  # for isolation's re-runs
        finally:
            with group.lock:
                group.out.pop(sub, None)
                ended = group.closed and not group.out
            if timer is not None:
                timer.cancel()
            if ended:  # e.g. the last sub-request of an abandoned group came back
                self._end(group)
        return self._resume(group, sub, outputs, error)

    def _resume(self, group, sub, outputs, error) -> list:
        """Hand ``sub``'s outcome to the flow (unless it was given up on) and return what the
        flow waits for next; finish the group when the flow is done."""
        with group.lock:
            late = group.closed or sub.branch is None
            if not late:
                sub.result, sub.error = outputs, error
                group.devices += [v for v in (outputs or {}).values()
                                  if isinstance(v, DeviceTensor)]
                waiting = group.flow.resume(sub)
                done = group.flow.done
                if done:
                    group.closed = True
        if late:  # abandoned: its result is dropped
            self.metrics.increment("bls_abandoned_subrequests_completed_total", stage=sub.stage)
            self.backend.release_devices([v for v in (outputs or {}).values()
                                          if isinstance(v, DeviceTensor)])
            return []
        if done:
            self._finish(group)
            return []
        return waiting

    def _stage_timed_out(self, group, sub) -> None:
        """(the clock) A sub-request outlived its stage's timeout: the flow hears so on a
        worker; the sub-request's result is dropped when it comes back."""
        stage = sub.stage
        error = DeadlineExceeded(stage, self.config.stage(stage).model,
                                 self.config.stage(stage).timeout_ms, "stage timeout")

        def resume():
            with group.lock:
                given_up = not group.closed and sub.branch is not None
            if given_up:
                self.metrics.increment("bls_abandoned_subrequests_total", stage=stage)
                self.subrequests.count_deadline(group, stage)
                self._drive(group, self._resume(group, sub, None, error))

        try:
            self.workers.submit(resume)
        except Exception:  # noqa: BLE001 - shut down: shutdown answers the group
            pass

    def _still_wanted(self, group, stage: str) -> bool:
        """Before a detached group's next step: answer its members whose client cancelled;
        False (the flow stopped) when none is left."""
        for member in group.live():
            if member.sender_lock is not None and self.answers.cancelled(member):
                if member.first("cancelled"):
                    self.metrics.increment("bls_cancelled_requests_total", stage=stage)
                self.answers.answer(member, error=Cancelled(stage))
        if group.live():
            return True
        self._abandon(group)
        return False

    def _finish(self, group) -> None:
        """The flow is done: each member answered from its rows, or the failure isolated or
        answered. Never raises."""
        self.hold.observe(time.monotonic() - group.started, group.rows)
        result, error = group.flow.result, group.flow.error
        group.flow = None
        bug = error is not None and not isinstance(error, PipelineError)
        handed = False  # to the isolation thread, which frees and ends the group
        try:
            if bug:
                self.log(f"group '{group.ids}' failed:\n"
                         + "".join(traceback.format_exception(error)), error=True)
            if error is None:
                try:
                    parts = group.split(result)
                except Exception:  # noqa: BLE001 - the run function's outputs are malformed
                    self.log(f"the outputs of group '{group.ids}' could not be split:\n"
                             f"{traceback.format_exc()}", error=True)
                    error, bug = internal_error(self.model), True
                else:  # the answers last: they wake execute's thread
                    self._free(group)
                    self.budget.earn(len(group.live()))
                    self.answers.answer_each(group.members, parts)
                    return
            live = group.live()
            if (live and isolatable(error, bug, group) and not self.subrequests.stopping
                    and (len(live) > 1 or getattr(error, "stage", ""))
                    and self.budget.left()):
                handed = self._queue_isolation(group, live, error)
                if handed:
                    return
                error = backlog_full(error, BACKLOG_GROUPS)
            if group.stage_failure is not None and getattr(error, "kind", None) is Kind.INVALID:
                error = group.stage_failure  # an innocent member was not the cause
            self._fail(group, internal_error(self.model) if bug else error)
        except Exception:  # noqa: BLE001 - the last resort: every member is answered
            self.log(f"answering group '{group.ids}' failed:\n{traceback.format_exc()}",
                     error=True)
            self._fail(group, internal_error(self.model))
        finally:
            if not handed:
                self._free(group)
                self._end(group)

    def _fail(self, group, error: PipelineError) -> None:
        self.answers.answer_each(group.members, error=error)

    def _free(self, group) -> None:
        devices, group.devices = group.devices, []
        if devices:
            self.backend.release_devices(devices)
        group.inputs = {}
        group.done = []

    # -- isolation (its own thread) ---------------------------------------------------------------
    def _queue_isolation(self, group, live: list[Job], error: PipelineError) -> bool:
        """Hand ``group`` to the isolation thread, unless BACKLOG_GROUPS already wait there or
        it is shut down: False."""
        with self._isolations_lock:
            if self.isolations >= BACKLOG_GROUPS:
                return False
            self.isolations += 1
        try:
            self.isolator.submit(self._isolated, group, live, error)
        except Exception:  # noqa: BLE001 - shut down: the group is answered with its error
            with self._isolations_lock:
                self.isolations -= 1
            return False
        return True

    def _isolated(self, group, live: list[Job], error: PipelineError) -> None:
        try:
            self._isolate(group, live, error)
        except Exception:  # noqa: BLE001 - the last resort: every member is answered
            self.log(f"isolating group '{group.ids}' failed:\n{traceback.format_exc()}",
                     error=True)
            self._fail(group, internal_error(self.model))
        finally:
            with self._isolations_lock:
                self.isolations -= 1
            self._free(group)
            self._end(group)

    def _isolate(self, group, live: list[Job], error: PipelineError) -> None:
        """Run each live member alone, one after the other, with the other instances'
        isolations held off; a member of a larger group that fails alone with a sub-model's
        INVALID runs once more at the end (a group of one already failed alone once). Each
        member hears its own outcome."""
        self.metrics.increment("bls_isolated_requests_total", len(live))
        with self.exclusive.held(group.latest().deadline.end) as held:
            if not held:  # every deadline passed while others isolated: no one is to blame
                for member in live:
                    self._deadline(member)
                return
            memo = Memo(group.done, self.batching)
            group.done = []
            again = []
            for member in live:
                if not self.budget.spend(1):  # spent meanwhile: by a stage rejecting every row
                    self._answer(member, None, error)
                    continue
                # A group of one already failed in the sub-model's batch: straight to a batch
                # of its own.
                outputs, failure = self._alone(member, group.detached, memo,
                                               own_batch=len(live) == 1)
                if (failure is not None and failure.kind is Kind.INVALID and failure.stage
                        and len(live) > 1 and self.budget.spend(1)):
                    again.append(member)
                else:
                    self._answer(member, outputs, failure)
            for member in again:
                self._answer(member, *self._alone(member, group.detached, memo, own_batch=True))

    def _fill(self, sub) -> int | None:
        """Pad ``sub`` to its stage model's ``max_batch_size`` rows by repeating its last row:
        Triton's dynamic batcher adds no other request to a full batch, so its answer is its
        rows' own. Returns its own row count, or None when nothing was padded (the stage does
        not batch, the rows already fill a batch, or they stay on the GPU)."""
        full = self.setup.max_rows.get(sub.stage, 1)
        values = list(sub.inputs.values())
        if (sub.stage not in self.batching or self.pass_through.get(sub.stage) or not values
                or not all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in values)):
            return None
        rows = len(values[0])
        if rows == 0 or rows >= full:
            return None
        sub.inputs = {name: np.concatenate([value, np.repeat(value[-1:], full - rows, axis=0)])
                      for name, value in sub.inputs.items()}
        return rows

    def _answer(self, member: Job, outputs, failure) -> None:
        if outputs is None and failure is None:  # it was answered meanwhile: its re-run's
            self.budget.earn(1)                  # token back (a deadline is no stage's fault)
            return
        if self.answers.answer(member, outputs, failure) and failure is None:
            self.budget.earn(1)

    def _alone(self, member: Job, detached: bool, memo: Memo | None = None,
               own_batch: bool = False):
        """``member`` run alone on this thread, its stages one after the other, each from
        ``memo`` when its group already got it, and with ``own_batch`` in a sub-model batch of
        its own (``_fill``): (its rows' outputs, None) or (None, its error)."""
        if member.answered:
            return None, None
        solo = groups.Group([member], self.first_stage, solo=True)
        solo.detached = detached
        try:
            run = flow.Flow(self.run(solo.inputs, flow.SubRequest, self._setup(solo)))
            waiting = run.start()
            while waiting and not run.done:
                sub = waiting.pop(0)
                if member.answered or (detached and not self._still_wanted(solo, sub.stage)):
                    run.close()
                    return None, None
                known = None if memo is None else memo.outputs(sub.stage, sub.inputs,
                                                               sub.outputs)
                if known is not None:
                    sub.result, sub.error = known, None
                    self.metrics.increment("bls_isolation_reused_subrequests_total",
                                           stage=sub.stage)
                else:
                    rows = self._fill(sub) if own_batch else None
                    sub.result, sub.error = self.subrequests.send(solo, sub)
                    if rows is not None and sub.result is not None:
                        sub.result = {name: value[:rows] for name, value in sub.result.items()}
                solo.devices += [v for v in (sub.result or {}).values()
                                 if isinstance(v, DeviceTensor)]
                waiting += run.resume(sub)
            if run.error is not None:
                if isinstance(run.error, PipelineError):
                    return None, run.error
                self.log(f"request '{member.request_id}' failed alone:\n"
                         + "".join(traceback.format_exception(run.error)), error=True)
                return None, internal_error(self.model)
            return solo.split(run.result)[0], None
        except Exception:  # noqa: BLE001 - as any bug: INTERNAL, logged
            self.log(f"request '{member.request_id}' failed alone:\n{traceback.format_exc()}",
                     error=True)
            return None, internal_error(self.model)
        finally:
            self._free(solo)

    # -- metrics ----------------------------------------------------------------------------------
    def _flush_metrics(self, histograms_due: float) -> None:
        """(the clock) Publish pending counters and gauges (and, every HISTOGRAM_FLUSH_SECONDS,
        the histograms), then again in FLUSH_SECONDS, whatever happens."""
        now = time.monotonic()
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
            self.clock.at(now + FLUSH_SECONDS, self._flush_metrics,
                          now + HISTOGRAM_FLUSH_SECONDS if histograms else histograms_due)

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """``finalize``: r24.10 refuses sub-requests from now on, so no new one is sent (a group
        that needs one is answered UNAVAILABLE); wait for those out (bounded), answer whatever
        is left UNAVAILABLE, stop the clock and the workers, publish the metrics. No pb_utils
        call happens after it returns. Never raises."""
        try:
            self.subrequests.stopping = True
            give_up = time.monotonic() + SHUTDOWN_DRAIN_SECONDS
            while self.answers.pending and time.monotonic() < give_up:
                time.sleep(0.02)
            left = self.answers.answer_all(shutting_down(self.model))
            if left:
                self.log(f"answered {left} request(s) still pending at shutdown")
        except BaseException:  # noqa: BLE001 - the rest of the shutdown happens all the same
            self.log(f"shutdown failed:\n{traceback.format_exc()}", error=True)
        finally:
            try:
                self.clock.close(SHUTDOWN_THREADS_SECONDS)
                stuck = (self.workers.shutdown(SHUTDOWN_THREADS_SECONDS)
                         + self.isolator.shutdown(SHUTDOWN_THREADS_SECONDS))
                if stuck:
                    self.log(f"{stuck} thread(s) still wait on a sub-model at shutdown: left to "
                             "the process's exit; they make no pb_utils call", error=True)
            except BaseException:  # noqa: BLE001 - the rest of finalize runs all the same
                self.log(f"stopping the threads failed:\n{traceback.format_exc()}", error=True)
            try:
                self.metrics.close()
            except BaseException:  # noqa: BLE001 - the backend is finalized all the same
                self.log(f"publishing the last metrics failed:\n{traceback.format_exc()}",
                         error=True)
            self.backend.finalize()


def python_model(pipeline: PipelineDef | str) -> type:
    """The ``TritonPythonModel`` class of an orchestrator running ``pipeline`` (a definition, or
    the name of a registered one). A model.py is then one line: ``TritonPythonModel =
    python_model(...)``."""
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
