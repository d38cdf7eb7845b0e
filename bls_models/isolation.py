"""Isolation: when a group fails with an error one request may cause, find the requests that
cause it, so only they hear of it.

Triton's onnxruntime backend runs a sub-model's dynamic batch as one ONNX Runtime call, so one
bad row fails every row of that batch: the group's, and rows of other requests the sub-model's
batcher put with them. ``bisect`` re-runs the failed group's live members in halves, each half
in a sub-model batch of its own — every sub-request of an attempt is padded to its stage
model's ``max_batch_size`` by repeating its last row (``pad``), and Triton's batcher adds
nothing to a full batch — until each failing half is one request: that request is the cause. A
group whose failed sub-request may have shared a batch is first re-run whole, padded (the cause
may have been another client's row). An attempt takes from ``Memo`` every stage the group
already got answered (a batching model answers a row from that row alone), so it sends the
failing stage, and what follows it, only. Attempts run within the members' deadlines; a failure
no row causes (a deadline, a full queue) ends the attempt's members with that failure, which is
retryable, never another request's error. Pure Python over numpy.
"""

from __future__ import annotations

import hashlib

import numpy as np

from bls_models.drive import Abandoned
from bls_models.errors import Kind, PipelineError


def row_caused(error: BaseException) -> bool:
    """Whether ``error`` may come from one request's rows: a sub-model rejecting its data, the
    run function's ``InvalidInput``, or a bug of the run function (it raised, or its outputs
    do not fit the rows)."""
    return not isinstance(error, PipelineError) or error.kind is Kind.INVALID


def pad(inputs: dict, full: int) -> tuple[dict, int | None]:
    """``inputs`` repeated to ``full`` rows by their last row, and their own row count (None:
    left as they are, when they fill a batch already or are not host arrays)."""
    values = list(inputs.values())
    if not values or not all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in values):
        return inputs, None
    rows = len(values[0])
    if rows == 0 or rows >= full:
        return inputs, None
    return {name: np.concatenate([value, np.repeat(value[-1:], full - rows, axis=0)])
            for name, value in inputs.items()}, rows


def bisect(members: list, error: BaseException, shared: bool, attempt, settle) -> None:
    """Find who of ``members`` (a group that failed with ``error``, row-caused) causes it.
    ``attempt(part)`` runs ``part`` padded and returns each one's outputs, or raises;
    ``settle(member, outputs_or_error)`` gives a member its outcome."""
    if len(members) == 1 and not shared:
        settle(members[0], error)
        return
    todo = [members] if shared else _halves(members)
    while todo:
        part = [member for member in todo.pop() if member.outcome is None]
        if not part:
            continue
        try:
            results = attempt(part)
        except Abandoned:
            continue  # every member of the part was answered meanwhile
        except Exception as failure:  # noqa: BLE001 - the attempt's outcome
            if row_caused(failure) and len(part) > 1:
                todo += _halves(part)
            else:
                for member in part:
                    settle(member, failure)
        else:
            for member, outputs in zip(part, results):
                settle(member, outputs)


def _halves(part: list) -> list[list]:
    middle = len(part) // 2
    return [part[middle:], part[:middle]]  # the first half is taken first


class Memo:
    """The rows a failed group's sub-requests got answered, by stage and row contents: an
    attempt takes a sub-request's outputs from here when the group got every one of its rows
    (``done``: (stage, inputs, outputs) of stages whose model batches, host arrays only)."""

    def __init__(self, done) -> None:
        self.rows: dict[bytes, tuple[dict, int]] = {}
        for stage, inputs, outputs in done:
            if _host(inputs) and _host(outputs):
                names = sorted(inputs)
                for row in range(len(inputs[names[0]]) if names else 0):
                    self.rows.setdefault(_row_key(stage, inputs, names, row), (outputs, row))

    def outputs(self, stage: str, inputs: dict, wanted) -> dict | None:
        """``wanted`` outputs for every row of ``inputs`` to ``stage``, or None."""
        if not self.rows or not inputs or not wanted or not _host(inputs):
            return None
        names = sorted(inputs)
        found = []
        for row in range(len(inputs[names[0]])):
            hit = self.rows.get(_row_key(stage, inputs, names, row))
            if hit is None or any(name not in hit[0] for name in wanted):
                return None
            found.append(hit)
        if not found:
            return None
        return {name: np.stack([outputs[name][row] for outputs, row in found]) for name in wanted}


def _row_key(stage: str, inputs: dict, names: list[str], row: int) -> bytes:
    digest = hashlib.blake2b(stage.encode(), digest_size=16)
    for name in names:
        value = inputs[name]
        digest.update(f"\0{name}\0{value.dtype.str}\0{value.shape[1:]}\0".encode())
        digest.update(np.ascontiguousarray(value[row]).data)
    return digest.digest()


def _host(tensors: dict) -> bool:
    return all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in tensors.values())
