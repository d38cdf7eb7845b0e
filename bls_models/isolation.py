"""Isolation: when a group fails with an error one request may cause, find who causes it.

One bad row fails a whole sub-model batch, the group's and whatever the batcher added.
``bisect`` re-runs the members in halves, each padded to a full batch (the batcher adds nothing
to one), down to the one that causes it; a group that may have shared its batch is first re-run
whole, padded. ``Memo`` gives an attempt the stages the group got. A failure no row causes ends
an attempt's members with it: retryable, never another's error. Pure Python.
"""

from __future__ import annotations

import hashlib

import numpy as np

from bls_models.drive import Abandoned
from bls_models.errors import Kind, PipelineError


def row_caused(error: BaseException) -> bool:
    """Whether ``error`` may come from one request's rows: a sub-model rejecting its data, or
    the run function's ``InvalidInput``. A bug of the pipeline's code (a ``TypeError``, an
    ``IndexError``, ...) is no row's fault: INTERNAL for its group, never bisected."""
    return isinstance(error, PipelineError) and error.kind is Kind.INVALID


def pad(inputs: dict, full: int) -> tuple[dict, int | None]:
    """``inputs`` (host arrays: an attempt keeps nothing on a GPU) repeated to ``full`` rows by
    their last row, and their own row count (None: left as they are, a full batch already)."""
    rows = len(next(iter(inputs.values()))) if inputs else 0
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
    """The rows a failed group's sub-requests got answered (``done``: (stage, inputs,
    outputs)), by stage and row contents: an attempt's sub-request is answered from here when
    every one of its rows is."""

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
