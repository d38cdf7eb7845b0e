"""The one sub-request wrapper: what a group's ``call(stage, ...)`` does, on a worker thread.

Each sub-request gets the time its group has left — its latest live member's deadline, capped
by the stage's ``<stage>_timeout_ms`` — twice: as its Triton ``timeout``, computed as it is sent
(the sub-model's queue drops it when it passes), and as the limit the runtime answers by (a
sub-request already running cannot be stopped in r24.10; it is abandoned and its result dropped).
One whose limit passed before a thread took it is never sent. Errors keep where they happened: an
error response is classified (``errors.classify_sub_error``), while an exception of this runtime's
own code is ``Kind.INTERNAL``, logged, answered INTERNAL naming the stage and never isolated.
"""

from __future__ import annotations

import time
import traceback

from bls_models.backend import DeviceTensor, Finalized
from bls_models.errors import Code, DeadlineExceeded, Kind, PipelineError, internal_error, sub_request_failed


def shutting_down(model: str) -> PipelineError:
    return PipelineError(Code.UNAVAILABLE, f"model '{model}' is shutting down")


class SubRequests:
    def __init__(self, backend, config, metrics, pass_through: dict[str, tuple[str, ...]],
                 model: str, log) -> None:
        self.backend, self.config, self.metrics, self.model, self.log = (
            backend, config, metrics, model, log)
        # Stage -> outputs kept on the GPU (gpu_tensors on, the stage's model KIND_GPU).
        self.keep = {stage: frozenset(names) for stage, names in pass_through.items()}
        self.stopping = False  # finalize began: r24.10's exec raises from now on
        key = metrics.key
        self.out: set = set()  # sub-requests out now (abandoned ones included)
        metrics.watch("bls_inflight_subrequests", self.out.__len__)
        self._models = {name: stage.model for name, stage in config.stages.items()}
        self._rows = {stage: key("bls_subrequest_rows", stage=stage) for stage in config.stages}
        self._latency = {stage: key("bls_stage_latency_seconds", stage=stage)
                         for stage in config.stages}

    def limit(self, group, stage: str, now: float) -> tuple[float, str, float]:
        """(seconds left, what limits, that limit in ms) for a sub-request of ``group`` to
        ``stage`` sent at ``now``."""
        last = group.latest()
        left = last.deadline.end - now
        timeout_ms = self.config.stage(stage).timeout_ms
        if timeout_ms and timeout_ms / 1e3 < left:
            return timeout_ms / 1e3, "stage timeout", timeout_ms
        return left, last.deadline.label, last.deadline.budget_ms

    def send(self, group, sub) -> tuple[dict | None, PipelineError | None]:
        """Send ``sub`` for ``group`` and wait: (outputs, None) or (None, the client's error)."""
        stage = sub.stage
        model = self._models[stage]
        if self.stopping:
            return None, shutting_down(self.model)
        now = time.monotonic()
        left, what, limit_ms = self.limit(group, stage, now)
        if left <= 0:
            self.count_deadline(group, stage)
            return None, DeadlineExceeded(stage, model, limit_ms, what)
        group.stage = stage
        metrics = self.metrics
        rows = next((len(v) for v in sub.inputs.values() if not isinstance(v, DeviceTensor)),
                    group.rows)
        self.out.add(sub)
        inputs, sub.inputs = sub.inputs, None  # sent: not kept beyond this call
        try:
            outputs, message = self.backend.infer(
                model, inputs, sub.outputs, group.ids, max(1, int(left * 1e6)),
                self.keep.get(stage, frozenset()) if self.config.gpu_tensors else frozenset(),
                sub.reduce)
        except Finalized:
            return None, shutting_down(self.model)
        except Exception:  # noqa: BLE001 - exec or this runtime failed: the stage's own failure
            if self.stopping:  # r24.10's exec raises once finalize has begun
                return None, shutting_down(self.model)
            self.log(f"stage '{stage}': sub-request failed:\n{traceback.format_exc()}",
                     error=True)
            failure = internal_error(self.model, stage)
            self.count_error(stage, Kind.INTERNAL)
            group.stage_failure = group.stage_failure or failure
            return None, failure
        finally:
            self.out.discard(sub)
            metrics.record(observations=((self._rows[stage], rows),
                                         (self._latency[stage], time.monotonic() - now)))
        if message is not None:
            failure = sub_request_failed(stage, model, message)
            self.count_error(stage, failure.kind)
            if failure.kind is not Kind.INVALID:
                group.stage_failure = group.stage_failure or failure
            return None, failure
        return outputs, None

    def count_error(self, stage: str, kind: Kind) -> None:
        self.metrics.increment("bls_subrequest_errors_total", stage=stage, kind=kind.value)

    def count_deadline(self, group, stage: str, members=None) -> None:
        """A deadline passed in ``stage``: once per sub-request (the stage's errors), and once
        per request (``members``: the group's live ones) at the first stage it hit."""
        self.count_error(stage, Kind.DEADLINE)
        for member in (group.live() if members is None else members):
            if member.first("deadline"):
                self.metrics.increment("bls_deadline_exceeded_total", stage=stage)
