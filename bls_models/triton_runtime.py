"""Runs a pipeline inside a Triton python-backend model: ``execute``, its groups, shutdown.

``execute`` is the plainest per-batch BLS with its time kept: it checks each request, stacks
the batch into groups, runs them on the pool (``drive``) and keeps their time on its own thread
until every request has its answer. Invariants (the unit tests' fake ``pb_utils`` checks them):

1. Every request that reaches ``execute`` has exactly one final answer, whatever raises: in its
   list, or sent as soon as it is decided. A batch OWE_AFTER_SECONDS old may leave its unanswered
   requests owed, answered by the keeper thread, if they fit the instance's ``max_owed_answers``
   (0: nothing is ever owed past ``execute``); else ``execute`` holds on.
2. No answer leaves after its deadline (+ the documented slack): ``execute`` sends each one
   still waiting when its deadline, or its stage's timeout, passes.
3. A group holds its thread until nothing of it is out, and sends nothing once every member
   is answered (``Abandoned``). A group finding no free thread is refused.
4. A request is charged only for its own rows: its outputs or its own error. A failure one row
   may cause is isolated; one no row causes is retryable, never another's error.

docs/orchestrator.md follows one request through it.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import replace

import numpy as np

from bls_models import repository
from bls_models import spec as S
from bls_models.backend import Backend, DeviceTensor, Finalized, NotSent
from bls_models.drive import Abandoned, Call, Pool, drive
from bls_models.errors import (
    Cancelled,
    Code,
    DeadlineExceeded,
    InvalidInput,
    Kind,
    PipelineError,
    internal_error,
    sub_request_failed,
)
from bls_models.group import Group, Job
from bls_models.isolation import Memo, bisect, pad, row_caused
from bls_models.metrics import Metrics
from bls_models.spec import PipelineDef, registered

_NUMPY = {name: np.dtype(dtype) for name, dtype in S.DTYPES.items()}
CANCEL_CHECK_SECONDS = 0.1      # a batch this old asks its clients whether they left, this often
OWE_AFTER_SECONDS = 0.1         # a batch this old may leave what is left owed (max_owed_answers)
SHUTDOWN_DRAIN_SECONDS = 10.0   # finalize waits this long for what runs and what is out
SHUTDOWN_THREADS_SECONDS = 1.0  # then for the metrics' thread


class Orchestrator:
    def __init__(self, pb_utils, args: dict, pipeline: PipelineDef | str) -> None:
        self.model = args["model_name"]
        self.backend = Backend(pb_utils, self.model)
        self.definition = pipeline if isinstance(pipeline, PipelineDef) else registered(pipeline)
        plan = repository.plan(args, self.definition)
        self.config, self.run, self.check, self.setup = plan.config, plan.run, plan.check, plan.setup
        self.batching, self.input_names, self.keep = plan.batching, plan.input_names, plan.keep
        self.first_stage, self.group_rows = plan.first_stage, plan.group_rows
        self.output_dtypes = {name: _NUMPY[kind] for name, kind in plan.output_types.items()}
        self.log = self.backend.log
        self.backend.keep_host = self.config.gpu_tensors == "always"
        self.metrics = Metrics(self.backend, self.model, list(self.config.stages),
                               stub=str(os.getpid()))
        key = self.metrics.key
        self._codes = {code: key("bls_requests_total", code=code) for code in S.REQUEST_CODES}
        self._latency = key("bls_request_latency_seconds")
        self._stage_keys = {stage: (key("bls_subrequest_rows", stage=stage),
                                    key("bls_stage_latency_seconds", stage=stage))
                            for stage in self.config.stages}
        self.inflight = 0  # execute's thread only
        # r24.10 runs one execute at a time per instance (pb_stub.cc 2157-2176, 381-388): one
        # lock over the outcomes and sub-requests out; ``woken`` wakes execute's thread.
        self.lock, self.woken = threading.Lock(), threading.Event()
        self.out: set = set()  # sub-requests out (set operations hold under the GIL)
        self.abandoned: set = set()  # those of them no request waits for (under ``lock``)
        self.owed: dict[Job, Group] = {}  # answered by the keeper, past execute (docs: Owed answers)
        self.keeper_woken, self.closing = threading.Event(), False
        self.metrics.watch("bls_inflight_requests", lambda: self.inflight)
        self.metrics.watch("bls_inflight_subrequests", self.out.__len__)
        self.metrics.watch("bls_owed_answers", self.owed.__len__)
        self.log(f"orchestrating '{self.definition.name}': {self.config}; contracts "
                 f"{ {stage: c.name for stage, c in plan.contracts.items()} }; groups of up to "
                 f"{self.group_rows} rows; kept by DLPack: {self.keep}")
        # Last: every pb_utils call of initialize is made before a second thread exists.
        self.pool = Pool(self.config.subrequest_threads, f"{self.model}-worker", self.log)
        self.keeper = threading.Thread(target=self._keep, name=f"{self.model}-keeper", daemon=True)
        if self.config.max_owed_answers:
            self.keeper.start()
        self.metrics.start(f"{self.model}-metrics")

    # -- execute (the stub's main thread) ---------------------------------------------------
    def execute(self, requests):
        """Answer the batch: every answer is given before this returns, but those left owed (at
        most ``max_owed_answers`` per instance, of a batch OWE_AFTER_SECONDS old). Never raises."""
        arrived = time.monotonic()
        jobs: list[Job] = []
        groups: list[Group] = []
        owed: set = set()
        self.inflight += len(requests)
        try:
            for request in requests:
                jobs.append(self._receive(request, arrived))
            live = [job for job in jobs if job.outcome is None]
            if live:
                groups += Group.form(live, self.group_rows, self.first_stage, arrived)
                for group in groups:  # on the pool: this thread keeps their time
                    if not self.pool.offer(self._run, group):
                        self._settle(group, PipelineError(
                            Code.UNAVAILABLE, f"orchestrator '{self.model}': all "
                            f"{self.pool.size} sub-request threads are busy: retry"))
                owed = self._wait(jobs, groups, arrived)
        except BaseException:  # noqa: BLE001 - execute must not raise (python_be.cc deletes every factory)
            self.log(f"execute failed:\n{traceback.format_exc()}", error=True)
            with self.lock:
                for request in requests[len(jobs):]:
                    jobs.append(Job(request, "", arrived, 0, 1, 1))
                for job in jobs:
                    if job.outcome is None and job not in owed:
                        job.outcome = internal_error(self.model)
        try:
            return self._respond(jobs, owed)
        finally:
            self.inflight -= len(requests)

    def _receive(self, request, arrived: float) -> Job:
        """A job for ``request``, with an outcome already if it cannot run. Never raises."""
        limits = (self.config.default_deadline_ms, self.config.max_deadline_ms)
        job = Job(request, "", arrived, 0, *limits)
        try:
            request_id, timeout_us, inputs, outputs = self.backend.read(request, self.input_names)
            job = Job(request, request_id, arrived, timeout_us, *limits)
            if isinstance(inputs, str):
                job.outcome = InvalidInput(f"the request has no input '{inputs}'")
                return job
            job.inputs, job.rows = inputs, len(next(iter(inputs.values())))
            job.outputs = (list(dict.fromkeys(n for n in outputs if n in self.output_dtypes))
                           or list(self.output_dtypes))
            self._validate(job.inputs)
        except PipelineError as error:
            job.outcome = error
        except Exception:  # noqa: BLE001 - unreadable, or a bug of the check: INTERNAL, logged
            self.log(f"reading or checking a request failed:\n{traceback.format_exc()}",
                     error=True)
            job.outcome = internal_error(self.model)
        return job

    def _validate(self, inputs: dict) -> None:
        """One request's inputs against the declared contract, before rows are stacked."""
        for name, value in inputs.items():
            if (value.dtype.kind == "f" and name not in self.definition.non_finite
                    and not np.isfinite(value).all()):
                bad = np.argwhere(~np.isfinite(value))[0]
                raise InvalidInput(f"{name} holds NaN or Inf (first at {tuple(int(i) for i in bad)}"
                                   f": {value[tuple(bad)]}): send finite values")
        if self.check is not None:
            self.check(inputs, self.setup)

    def _wait(self, jobs: list[Job], groups: list[Group], arrived: float) -> set:
        """Keep ``jobs``' time (``_tick``) until each has its outcome, or the batch is
        OWE_AFTER_SECONDS old and those still running fit the bound (returned: owed). An answer
        decided while others run is sent at once; from then on, clients are asked if they left."""
        kept: set[Job] = set()  # answers the sender could not take: returned instead
        check_at = owe_at = arrived + OWE_AFTER_SECONDS
        while True:
            now = time.monotonic()
            decided, pending, wake = self._tick(jobs, groups, now, kept)
            if not pending:
                return set()  # execute's list answers the rest
            # Only this thread adds to ``owed`` (the keeper only takes out): room seen is kept.
            if (now >= owe_at and len(pending) + len(self.owed) <= self.config.max_owed_answers
                    and self._senders(pending)):
                with self.lock:
                    self.owed.update((job, group) for group in groups
                                     for job in group.members if job in pending)
                self.keeper_woken.set()
                return set(pending)
            for job in decided + (self._ask(groups, pending) if now >= check_at else []):
                if not self._send(job):
                    kept.add(job)
            if now >= check_at:
                check_at = now + CANCEL_CHECK_SECONDS
            self.woken.wait(max(0.0, min(wake, check_at) - time.monotonic()))
            self.woken.clear()  # before the state is read again: no wake-up is lost

    def _keep(self) -> None:
        """The keeper thread: the owed requests' time, kept as ``_wait`` keeps a batch's; each
        answer is sent as soon as it is decided. Ends once closing with nothing owed."""
        check_at, until = 0.0, float("inf")
        while True:
            self.keeper_woken.wait(None if until == float("inf") else max(
                0.0, until - time.monotonic()))
            self.keeper_woken.clear()
            try:
                with self.lock:
                    owed = dict(self.owed)
                if not owed and self.closing:
                    return
                now = time.monotonic()
                groups = list(dict.fromkeys(owed.values()))
                decided, pending, wake = self._tick(list(owed), groups, now, set())
                for job in decided + (self._ask(groups, pending) if now >= check_at else []):
                    self._send(job, owed=True)
                    with self.lock:
                        del self.owed[job]
                    self.woken.set()  # an execute may wait for room
                if now >= check_at:
                    check_at = now + CANCEL_CHECK_SECONDS
                until = min(wake, check_at) if pending else wake
            except Exception:  # noqa: BLE001 - a bug: logged, and the keeper keeps on
                self.log(f"the keeper failed:\n{traceback.format_exc()}", error=True)
                until = time.monotonic() + CANCEL_CHECK_SECONDS

    def _tick(self, jobs: list[Job], groups: list[Group], now: float, kept: set):
        """(decided and not yet sent, still running, when to look again) of ``jobs``, once
        members past their deadline, or their stage's timeout, have their deadline errors."""
        with self.lock:
            for group in groups:
                self._expire(group, now)
            decided = [job for job in jobs if job.outcome is not None and not job.answered
                       and job not in kept]
            pending = [job for job in jobs if job.outcome is None]
            wake = min([float("inf"), *(job.end for job in pending),
                        *(ends for group in groups for _, _, ends, members in group.out.values()
                          if ends and any(m.outcome is None for m in members))])
        return decided, pending, wake

    def _senders(self, jobs: list[Job]) -> bool:
        """Whether each of ``jobs`` has its response sender (an owed job has no list)."""
        try:
            for job in jobs:
                job.sender = job.sender or self.backend.sender(job.request)
            return True
        except Exception:  # noqa: BLE001 - not owed then: execute holds them
            self.log(f"get_response_sender() failed:\n{traceback.format_exc()}", error=True)
            return False

    def _wake(self) -> None:
        self.woken.set()
        if self.owed:
            self.keeper_woken.set()

    def _ask(self, groups: list[Group], jobs: list[Job]) -> list[Job]:
        """Those of ``jobs`` whose client left, answered CANCELLED (each asks: an IPC round
        trip)."""
        left = []
        for job in jobs:
            try:
                if self.backend.is_cancelled(job.request):
                    left.append(job)
            except Exception:  # noqa: BLE001 - it goes on; its answer says how it ends
                self.log(f"is_cancelled() failed:\n{traceback.format_exc()}", error=True)
        with self.lock:
            left = [job for job in left if job.outcome is None]
            for job in left:
                group = next(g for g in groups if job in g.members)
                job.outcome = Cancelled(group.where())
                self.metrics.increment("bls_cancelled_requests_total", stage=group.where())
                self._closing(group, Kind.CANCELLED)
        return left

    def _expire(self, group: Group, now: float) -> list[Job]:
        """(under the lock) The live members of ``group`` whose time is up — their deadline, or
        their stage's timeout for a sub-request they wait on — given their deadline errors."""
        expired = []
        for stage, _, ends, members in list(group.out.values()):
            if ends and ends <= now:
                settings = self.config.stage(stage)
                for job in members:
                    if job.outcome is None:
                        job.outcome = DeadlineExceeded(stage, settings.model,
                                                       settings.timeout_ms, "stage timeout")
                        expired.append(job)
        for job in group.live():
            if job.end <= now:
                stage = group.where()
                job.outcome = DeadlineExceeded(stage, self.config.stage(stage).model,
                                               job.budget_ms, job.limit)
                expired.append(job)
        for job in expired:
            self.metrics.increment("bls_deadline_exceeded_total", stage=job.outcome.stage)
        if expired:
            self._closing(group, Kind.DEADLINE)
        return expired

    def _closing(self, group: Group, kind: Kind) -> None:
        """(under the lock) Each sub-request ``group`` (or an isolation attempt of it) has out
        whose requests all have their answers now is abandoned, for ``kind``: counted once."""
        for token, (stage, _, _, members) in group.out.items():
            if token not in self.abandoned and all(m.outcome is not None for m in members):
                self.abandoned.add(token)
                self.metrics.record(increments=(
                    (self.metrics.key("bls_abandoned_subrequests_total", stage=stage), 1),
                    (self.metrics.key("bls_subrequest_errors_total", stage=stage,
                                      kind=kind.value), 1)))

    # -- answers (execute's thread) -----------------------------------------------------------
    def _content(self, job: Job) -> tuple[str, dict]:
        """(code, what ``Backend.response`` builds) for ``job``'s outcome; INTERNAL when its
        outputs cannot be answered."""
        outcome = job.outcome
        if isinstance(outcome, dict):
            try:
                arrays = []
                for name in job.outputs:
                    array = np.ascontiguousarray(outcome[name], self.output_dtypes[name])
                    if array.ndim == 0 or array.shape[0] != job.rows:
                        raise ValueError(f"output '{name}' has shape {array.shape}, not "
                                         f"{job.rows} rows like the request")
                    arrays.append((name, array))
                outcome = self._non_finite(arrays)
                if outcome is None:
                    return "SUCCESS", {"arrays": arrays}
            except Exception:  # noqa: BLE001 - the orchestrator's own failure: INTERNAL
                self.log(f"the response of '{job.request_id}' could not be built:\n"
                         f"{traceback.format_exc()}", error=True)
                outcome = internal_error(self.model)
        return outcome.code.value, {"message": outcome.message, "code": outcome.code.value}

    def _non_finite(self, arrays: list) -> InvalidInput | None:
        """A request's failure if an output the contract keeps finite holds NaN or Inf: its
        inputs drove the models out of range (a finite -3e38 pixel does)."""
        for name, array in arrays:
            if (array.dtype.kind == "f" and name not in self.definition.non_finite
                    and not np.isfinite(array).all()):
                bad = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
                return InvalidInput(f"output {name} would hold {array[bad]} (first at {bad}): "
                                    f"the request's {', '.join(self.input_names)} drive the "
                                    "models out of range; send values they expect")
        return None

    def _send(self, job: Job, owed: bool = False) -> bool:
        """Answer ``job`` now, through its response sender; False (unanswered: execute's list
        answers it) if the sender was never used. An owed job, which has no list, gets the
        plainest answer then. Never raises."""
        code, content = self._content(job)
        for plainest in (False, owed):
            try:
                self.backend.send(job.request, **content, sender=job.sender)
                break
            except NotSent:
                self.log(f"could not answer '{job.request_id}':\n{traceback.format_exc()}",
                         error=True)
                if not owed:
                    return False
                code, content = "SEND_FAILED" if plainest else "INTERNAL", self._plain()
            except Exception:  # noqa: BLE001 - the sender is closed now (r24.10): no retry
                self.log(f"could not send the response of '{job.request_id}':\n"
                         f"{traceback.format_exc()}", error=True)
                code = "SEND_FAILED"
                break
        job.answered = True
        with self.backend.lock:  # the request may die here: an object call
            job.request = job.inputs = job.sender = None
        self._record([(job, code)])
        return True

    def _plain(self) -> dict:
        return {"message": internal_error(self.model).message, "code": "INTERNAL"}

    def _respond(self, jobs: list[Job], owed: set) -> list:
        """``execute``'s list: a response for each job not sent already nor owed. Never
        raises."""
        responses, answered = [], []
        for job in jobs:
            response = None
            if job in owed:
                responses.append(None)
                continue
            if not job.answered:
                job.answered = True
                code, content = self._content(job)
                for _ in range(2):  # then the plainest answer
                    try:
                        response = self.backend.response(**content)
                        break
                    except Exception:  # noqa: BLE001 - the plainer answer is tried next
                        self.log(f"a response could not be built:\n{traceback.format_exc()}",
                                 error=True)
                        code, content = "INTERNAL", self._plain()
                answered.append((job, code if response is not None else "SEND_FAILED"))
            responses.append(response)
            job.request = job.inputs = job.sender = None
        self._record(answered)
        return responses

    def _record(self, answered: list[tuple[Job, str]]) -> None:
        now = time.monotonic()
        self.metrics.record(increments=[(self._codes[code], 1) for _, code in answered],
                            observations=[(self._latency, now - job.arrived)
                                          for job, _ in answered])

    # -- a group (pool threads) ---------------------------------------------------------------
    def _run(self, group: Group) -> None:
        """Run ``group``; give each member its outcome (isolating a failure one row may
        cause). Never raises."""
        try:
            outputs = self._drive(group)
            parts = group.split(outputs)
        except Abandoned:
            return
        except Exception as error:  # noqa: BLE001 - the group's failure, or a bug
            self._failed(group, error)
        else:
            with self.lock:
                for member, part in zip(group.members, parts):
                    if member.outcome is None:
                        member.outcome = part
            self._wake()
        finally:
            group.done = []

    def _drive(self, group: Group, memo: Memo | None = None):
        setup, group.keep = self.setup, {} if group.pad else self.keep
        if any(len(member.outputs) != len(self.output_dtypes) for member in group.members):
            setup = replace(setup, asked=tuple((member.rows, frozenset(member.outputs))
                                               for member in group.members))
            group.keep = {}  # its run selects rows of a stage's outputs: host memory
        held: list = []  # DeviceTensors its stages kept: released under the lock at the end
        try:
            return drive(self.run(group.inputs, Call, setup),
                         lambda call: self._call(group, call, memo, held), self.pool)
        finally:
            if held:
                self.backend.clear(held)
            if group.observed:
                self.metrics.record(observations=group.observed)
                group.observed = []

    def _failed(self, group: Group, error: BaseException) -> None:
        live = group.live()
        if not isinstance(error, PipelineError):
            self.log(f"group '{group.ids}' failed:\n" + "".join(
                traceback.format_exception(error)), error=True)
        if not live:
            return
        error = group.stage_failure or error  # a stage failing as a whole: no isolation
        if not row_caused(error):
            self._settle(group, error)
            return
        self.metrics.increment("bls_isolated_requests_total", len(live))
        memo = Memo(group.done)
        group.done = []

        def attempt(part):
            trial = Group(part, self.first_stage, group.started, pad=True)
            trial.out = group.out  # its sub-requests are the group's: the timekeeper sees them
            return trial.split(self._drive(trial, memo))

        bisect(live, error, getattr(error, "shared", False), attempt,
               lambda member, outcome: self._settle(group, outcome, [member]))

    def _settle(self, group: Group, outcome, members=None) -> None:
        """Give ``members`` (all of ``group``'s) without an outcome ``outcome``; an error
        without its traceback, whose frames hold the sub-requests' arrays."""
        if not isinstance(outcome, (dict, PipelineError)):
            outcome = internal_error(self.model)  # a bug: logged where it was caught
        elif isinstance(outcome, PipelineError):
            outcome.__traceback__ = outcome.__context__ = outcome.__cause__ = None
        given = 0
        with self.lock:
            for member in members or group.members:
                if member.outcome is None:
                    member.outcome, given = outcome, given + 1
        if given and getattr(outcome, "kind", None) is Kind.DEADLINE:  # e.g. a queue's timeout
            self.metrics.increment("bls_deadline_exceeded_total", given, stage=outcome.stage)
        self._wake()

    def _call(self, group: Group, call: Call, memo: Memo | None, held: list) -> dict:
        """One sub-request of ``group``, sent on this thread: its outputs, else raises its
        failure (a ``PipelineError``) or ``Abandoned``."""
        stage, inputs, rows = call.stage, call.inputs, None
        if memo is not None:
            known = memo.outputs(stage, inputs, call.outputs)
            if known is not None:
                self.metrics.increment("bls_isolation_reused_subrequests_total", stage=stage)
                return known
        keep = group.keep.get(stage, frozenset())
        if group.pad and stage in self.batching:
            inputs, rows = pad(inputs, self.setup.max_rows[stage])
        sent = len(next(iter(call.inputs.values()))) if call.inputs else group.rows
        token, started = object(), time.monotonic()
        try:
            outputs, message = self.backend.infer(
                self.config.stages[stage].model, inputs, call.outputs, group.ids,
                lambda: self._admit(group, stage, token), keep, call.reduce)
        except (Abandoned, PipelineError):
            raise
        except Finalized:  # every member was answered before finalize began
            raise Abandoned from None
        except Exception:  # noqa: BLE001 - exec or this runtime failed: the stage's own failure
            self.log(f"stage '{stage}': sub-request failed:\n{traceback.format_exc()}",
                     error=True)
            self.metrics.increment("bls_subrequest_errors_total", stage=stage,
                                   kind=Kind.INTERNAL.value)
            raise internal_error(self.model, stage) from None
        finally:
            with self.lock:
                out = group.out.pop(token, None) is not None
                closed, abandoned = group.closed, token in self.abandoned
                self.abandoned.discard(token)
            if out:
                self.out.discard(token)
                rows_key, latency_key = self._stage_keys[stage]
                group.observed += ((rows_key, sent), (latency_key, time.monotonic() - started))
        if keep and outputs:
            held += [value for value in outputs.values() if isinstance(value, DeviceTensor)]
        if abandoned:
            self.metrics.increment("bls_abandoned_subrequests_completed_total", stage=stage)
        if closed:
            raise Abandoned
        if message is not None:
            raise self._failure(group, stage, message, sent)
        if rows is not None:
            outputs = {name: value[:rows] for name, value in outputs.items()}
        elif stage in self.batching:
            group.done.append((stage, call.inputs, outputs))
        return outputs

    def _admit(self, group: Group, stage: str, token: object) -> int:
        """(under the backend's lock, as a sub-request is made) Whether it is still wanted, and
        its time (µs): the latest live member's, capped by its stage's timeout."""
        cap = self.config.stages[stage].timeout_ms / 1e3
        with self.lock:
            last = group.latest()
            if last is None:
                raise Abandoned
            now = time.monotonic()
            left, ends = last.end - now, 0.0
            if cap and cap < left:
                left, ends = cap, now + cap
            if left <= 0:
                raise DeadlineExceeded(stage, self.config.stages[stage].model, last.budget_ms,
                                       last.limit)
            group.stage = stage
            group.out[token] = (stage, now, ends, group.members)
        self.out.add(token)
        if ends:
            self._wake()  # execute or the keeper has an earlier time to keep
        return max(1, int(left * 1e6))

    def _failure(self, group: Group, stage: str, message: str, rows: int) -> PipelineError:
        model = self.config.stage(stage).model
        failure = sub_request_failed(stage, model, message)
        # It may have shared a sub-model batch with other requests' rows.
        failure.shared = (not group.pad and stage in self.batching
                          and rows < self.setup.max_rows[stage])
        if failure.kind is not Kind.INVALID and group.stage_failure is None:
            # Apart from the one raised, whose traceback will hold the group.
            group.stage_failure = sub_request_failed(stage, model, message)
        self.metrics.increment("bls_subrequest_errors_total", stage=stage,
                               kind=failure.kind.value)
        return failure

    # -- counts, metrics, shutdown ------------------------------------------------------------
    def close(self) -> None:
        """``finalize``, which r24.10 runs only between two ``execute`` calls (``pb_stub.cc``
        2157-2176): every request is answered but the owed ones; what is out was abandoned or
        decides those. Wait (bounded) for it, answer the owed still undecided UNAVAILABLE, publish
        the metrics. No pb_utils call follows. Never raises."""
        try:
            self.closing = True
            stuck = self.pool.shutdown(SHUTDOWN_DRAIN_SECONDS)
            if stuck:
                self.log(f"{stuck} thread(s) still wait on a sub-model at shutdown: left to "
                         "the process's exit; they make no pb_utils call", error=True)
            with self.lock:
                for job in self.owed:
                    if job.outcome is None:
                        job.outcome = PipelineError(Code.UNAVAILABLE, f"orchestrator "
                                                    f"'{self.model}' is unloading: retry")
            self.keeper_woken.set()
            if self.keeper.is_alive():
                self.keeper.join(SHUTDOWN_DRAIN_SECONDS)
            self.metrics.close(SHUTDOWN_THREADS_SECONDS)
        except BaseException:  # noqa: BLE001 - the backend is finalized all the same
            self.log(f"shutdown failed:\n{traceback.format_exc()}", error=True)
        finally:
            self.backend.finalize()


def python_model(pipeline: PipelineDef | str) -> type:
    """The ``TritonPythonModel`` class of an orchestrator running ``pipeline`` (a definition, or
    a registered one's name): a model.py is ``TritonPythonModel = python_model(...)``. It is an
    ``Orchestrator``: Triton makes it with no arguments and calls ``initialize``, ``execute``
    and ``finalize``."""
    name = pipeline if isinstance(pipeline, str) else pipeline.name

    class TritonPythonModel(Orchestrator):
        def __init__(self) -> None:  # initialize sets it up
            pass

        def initialize(self, args):
            import triton_python_backend_utils as pb_utils

            Orchestrator.__init__(self, pb_utils, args, pipeline)

        def finalize(self):
            self.close()

    TritonPythonModel.pipeline = pipeline  # what modelgen.configs renders the config from
    TritonPythonModel.__qualname__ = f"TritonPythonModel[{name}]"
    return TritonPythonModel
