"""Each runtime mechanism turned off, for the ledger (docs/orchestrator.md): the test the ledger
names for a mechanism must fail without it. ``python -m tests.ledger --mutations`` runs each
named test in a pytest of its own with this module as a plugin (``-p tests.mutations``) and
``BLS_MUTATION`` naming the mechanism to turn off; it records whether the test failed.

Each entry: (what it turns off, the tests that must fail without it, how to turn it off).
"""

from __future__ import annotations

import os

import numpy as np


def _patch(target: str, replacement) -> None:
    module_name, _, attribute = target.rpartition(".")
    owner_name, _, cls = module_name.rpartition(".")
    import importlib

    try:
        owner = getattr(importlib.import_module(owner_name), cls)
    except (ImportError, AttributeError, ValueError):
        owner = importlib.import_module(module_name)
    setattr(owner, attribute, replacement)


def _single_groups(jobs, max_rows, first_stage, started):
    from bls_models.group import Group

    return [Group([job], first_stage, started) for job in jobs]


def _unbounded_offer(self, function, *args):
    import threading

    threading.Thread(target=function, args=args, daemon=True).start()
    return True


def plain_wait(self, jobs, groups, arrived):
    """What the plainest BLS does in ``Orchestrator._wait``'s place: wait until every request
    has its outcome, nothing more (also the ledger's stand-in). Nothing owed."""
    while any(job.outcome is None for job in jobs):
        self.woken.wait(1.0)
        self.woken.clear()
    return set()


def _due_only():
    """``Orchestrator._tick`` as before issue 47: a decided answer leaves early only if it is
    an error (a deadline, a cancellation) or past its deadline; the rest waits for the list."""
    from bls_models.errors import PipelineError
    from bls_models.triton_runtime import Orchestrator

    original = Orchestrator._tick

    def tick(self, jobs, groups, now, kept):
        decided, pending, wake = original(self, jobs, groups, now, kept)
        return ([job for job in decided if isinstance(job.outcome, PipelineError)
                 or job.end <= now], pending, wake)
    return tick


def _settle_all(self, group, error):
    self._settle(group, group.stage_failure or error)


def _no_stage_failure(self, group, stage, message, rows):
    from bls_models.errors import sub_request_failed

    failure = sub_request_failed(stage, self.config.stage(stage).model, message)
    failure.shared = not group.pad and rows < self.setup.max_rows.get(stage, 1)
    return failure


def _keeping_always():
    """``Orchestrator._call`` with every stage's outputs kept where they are, whatever its run:
    a group whose requests asked for different outputs, and an isolation attempt, too."""
    from bls_models.triton_runtime import Orchestrator

    original = Orchestrator._call

    def call(self, group, *args):
        group.keep = self.keep
        return original(self, group, *args)
    return call


def _clear_without_freeing(self, *collections):
    """``Backend.clear`` as it was: the containers emptied, a kept tensor left to whoever drops
    it last."""
    with self.lock:
        for collection in collections:
            collection.clear()


R = "tests/unit/test_runtime.py"
ISO = "tests/unit/test_isolation.py"
F = "tests/unit/test_review_findings.py"
MUTATIONS = {
    "validate": ("per-request validation before rows are stacked",
                 [f"{F}::test_7_a_non_finite_input_is_invalid_arg_alone_before_any_sub_request",
                  f"{ISO}::test_the_per_request_check_runs_before_rows_are_stacked"],
                 lambda: _patch("bls_models.triton_runtime.Orchestrator._validate",
                                lambda self, inputs: None)),
    "groups": ("a batch stacked into groups",
               [f"{R}::test_each_request_gets_its_own_rows_returned_in_one_message"],
               lambda: _patch("bls_models.group.Group.form", staticmethod(_single_groups))),
    "pool-bound": ("the pool's bound (a group finding no free thread is refused)",
                   [f"{R}::test_the_pool_bounds_what_is_out_and_refuses_what_it_cannot_run"],
                   lambda: _patch("bls_models.drive.Pool.offer", _unbounded_offer)),
    "pool-branches": ("gathered branches on the pool",
                      ["tests/unit/test_drive.py::test_gathered_branches_run_together_on_the_pool"],
                      lambda: _patch("bls_models.drive.Pool.offer",
                                     lambda self, function, *args: False)),
    "clock": ("execute's thread keeps time: answers sent at their deadline while others run",
              [f"{R}::test_a_deadline_both_branches_miss_is_answered_on_time_and_counted_once",
               f"{F}::test_1_a_started_requests_deadline_is_kept_while_another_waits"],
              lambda: _patch("bls_models.triton_runtime.Orchestrator._wait", plain_wait)),
    "owed": ("a slow batch's requests owed past execute, within the bound",
             ["tests/unit/test_owed.py::test_a_slow_request_frees_its_instance_and_is_answered_later_on_time"],
             lambda: _patch("bls_models.triton_runtime.Orchestrator._senders",
                            lambda self, jobs: False)),
    "ready": ("an answer decided while batch-mates run leaves at once",
              ["tests/unit/test_owed.py::test_an_answer_leaves_when_its_group_is_done_whatever_its_batch_mates_do"],
              lambda: _patch("bls_models.triton_runtime.Orchestrator._tick", _due_only())),
    "stage-timeout": ("a stage's timeout kept, in re-runs too",
                      [f"{F}::test_2_a_stage_timeout_holds_in_a_re_run"],
                      lambda: _patch("bls_models.triton_runtime.Orchestrator._expire",
                                     _expire_deadlines_only)),
    "gate": ("the gate: nothing sent for a group whose members are all answered",
             [f"{R}::test_a_group_answered_between_two_calls_sends_nothing_more"],
             lambda: _patch("bls_models.triton_runtime.Orchestrator._admit", _admit_always)),
    "cancellation": ("long batches ask whether their clients left",
                     [f"{R}::test_a_cancelled_request_stops_before_its_next_stage_and_is_counted_once"],
                     lambda: _patch("bls_models.triton_runtime.Orchestrator._ask",
                                    lambda self, groups, jobs: [])),
    "isolation": ("isolation: halves in batches of their own",
                  [f"{ISO}::test_a_poisoned_row_fails_alone_and_the_others_get_their_own_rows",
                   f"{F}::test_3_an_innocent_never_hears_another_requests_invalid_arg"],
                  lambda: _patch("bls_models.triton_runtime.Orchestrator._failed",
                                 _settle_all)),
    "padding": ("an attempt padded to a full batch",
                [f"{ISO}::test_a_request_alone_rejected_in_a_shared_batch_is_tried_again_in_a_batch_of_its_own"],
                lambda: _patch("bls_models.triton_runtime.pad",
                               lambda inputs, full: (inputs, None))),
    "memo": ("the memo: an attempt re-uses the stages its group got",
             [f"{ISO}::test_an_attempt_sends_only_the_stage_that_failed_in_a_full_batch_of_its_own"],
             lambda: _patch("bls_models.isolation.Memo.outputs",
                            lambda self, stage, inputs, wanted: None)),
    "stage-failure": ("a failure no row causes ends isolation",
                      [f"{ISO}::test_a_stage_failing_as_a_whole_is_not_re_sent_while_a_bad_row_is_isolated"],
                      lambda: _patch("bls_models.triton_runtime.Orchestrator._failure",
                                     _no_stage_failure)),
    "lock": ("the backend's lock over pb_utils' object calls",
             ["tests/unit/test_fault_injection.py"],
             lambda: _patch("bls_models.backend.Backend.__init__", _unlocked_backend)),
    "no-cycles": ("no reference cycles (frames that hold the error they raised)",
                  ["tests/unit/test_memory.py::test_no_path_leaves_reference_cycles"],
                  lambda: _patch("bls_models.drive._gather", _gather_keeping_errors)),
    "not-sent": ("an answer that cannot be handed over early goes back to execute's list",
                 ["tests/unit/test_failure_paths.py::test_an_answer_that_cannot_be_built_or_handed_over_early_is_still_given"],
                 lambda: _patch("bls_models.backend.NotSent", _Unrelated)),
    "own": ("a borrowed output copied before its response goes",
            ["tests/unit/test_owned_outputs.py"],
            lambda: _patch("bls_models.backend.Backend.own", staticmethod(lambda array: array))),
    "non-finite-outputs": ("outputs checked finite before the answer is built",
                           ["tests/unit/test_failure_paths.py::test_an_output_driven_to_nan_fails_its_own_request_alone"],
                           lambda: _patch("bls_models.triton_runtime.Orchestrator._non_finite",
                                          lambda self, arrays: None)),
    "kept-whole": ("stage outputs kept on the GPU only where every row is taken whole",
                   ["tests/unit/test_profiles.py::test_each_request_gets_what_its_pipeline_computes_for_it_alone[gpu-pipeline-mixed-outputs]",
                    "tests/unit/test_isolation.py::test_an_attempt_sends_only_the_stage_that_failed_in_a_full_batch_of_its_own[gpu]"],
                   lambda: _patch("bls_models.triton_runtime.Orchestrator._call",
                                  _keeping_always())),
    "kept-freed": ("a kept tensor freed under the backend's lock",
                   ["tests/unit/test_gpu_tensors.py::test_the_gpu_profile_keeps_pixels_on_the_gpu_and_frees_them_under_the_lock"],
                   lambda: _patch("bls_models.backend.Backend.clear", _clear_without_freeing)),
    "drain-at-finalize": ("finalize waits for what is out",
                          [f"{R}::test_shutdown_waits_for_the_sub_requests_out_and_then_makes_no_pb_utils_call"],
                          lambda: _patch("bls_models.triton_runtime.SHUTDOWN_DRAIN_SECONDS", 0.0)),
}


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Unrelated(Exception):
    """Stands in for NotSent: nothing raises it, so every failure counts as a send's."""


def _expire_deadlines_only(self, group, now):
    """``_expire`` without the stages' timeouts: members' deadlines only."""
    from bls_models.errors import DeadlineExceeded

    expired = [job for job in group.live() if job.end <= now]
    for job in expired:
        stage = group.where()
        job.outcome = DeadlineExceeded(stage, self.config.stage(stage).model, job.budget_ms,
                                       job.limit)
    return expired


def _admit_always(self, group, stage, token):
    """``_admit`` that sends whatever is asked, for a second: no check of who still wants it."""
    import time

    with self.lock:
        group.out[token] = (stage, time.monotonic(), 0.0, group.members)
    self.out.add(token)
    return 1_000_000


def _unlocked_backend(self, pb_utils, model):
    import threading

    self.pb, self.model, self._cpu = pb_utils, model, None
    self.lock, self.finalized = _NoLock(), threading.Event()


def _gather_keeping_errors(awaitables, send, pool):
    """``drive._gather`` as it was: its branches keep their errors, and it raises from a
    local, so each failure's traceback holds frames that hold it."""
    import threading

    from bls_models.drive import Abandoned, _Branch
    from bls_models.errors import PipelineError

    branches = [_Branch(awaitable) for awaitable in awaitables]
    lock = threading.Lock()
    for branch in branches[1:]:
        if pool is None or not pool.offer(branch.run, lock, send, pool):
            break
    for branch in branches:
        branch.run(lock, send, pool)
    for branch in branches:
        branch.done.acquire()
    errors = [b.error for b in branches if b.error is not None]
    if errors:
        raise next((e for e in errors if isinstance(e, Abandoned)), None) or next(
            (e for e in errors if isinstance(e, PipelineError)), errors[0])
    return [branch.result for branch in branches]


def pytest_configure(config):
    name = os.environ.get("BLS_MUTATION")
    if name:
        MUTATIONS[name][2]()
        np.seterr(all="ignore")
