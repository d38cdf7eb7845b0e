"""Isolation: when a group fails with an error one request may cause, its members run alone, so
only the culprit hears of it.

The one policy: a failure one row may cause — a sub-model's ``Kind.INVALID`` (ONNX Runtime runs a
batch as one call, so one bad row fails all), or the run function's bug — makes each live member
run alone, one after the other, with the orchestrator's other instances' isolations held off
(``exclusive``), so a re-run meets no other re-run in the sub-model's batch. A member that fails
alone with a sub-model's ``INVALID`` runs once more at the end (the sub-model's batcher may have
put it with another request's bad row), this time in a batch of its own: its rows repeated to
the stage model's ``max_batch_size``, a batch Triton's batcher adds nothing to. A group of one
(it already failed in a shared batch) goes there at once. That answer is the member's own. Not
after a failure no row causes (the group's ``stage_failure``). Each re-run is paid from a
``Budget`` that every successful request refills: an innocent member's re-run pays for itself,
a stage that fails every row drains it and is then not re-run (its groups answered with their
error), and groups waiting for the lock reserve nothing, so a burst of them is not refused.
Isolations run on a thread of their own per instance, at most ``BACKLOG_GROUPS`` failed groups
waiting; beyond them a failed group's members hear UNAVAILABLE (``backlog_full``: retry).
A member re-run alone sends only what the group did not already get: each row a stage model
with a batch dimension answered for the group (a batching model answers a row from that row
alone) is taken from the group's answer, found by the row's contents (``Memo``). So a re-run
meets the failing stage, and what follows it, only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bls_models.errors import Code, Kind, PipelineError

POLL_SECONDS = 0.002        # between attempts at the cross-instance lock
EARNED_PER_SUCCESS = 1.0    # re-runs a successful request earns
RESERVE_GROUPS = 4          # the budget's capacity, in full groups
BACKLOG_GROUPS = 8          # failed groups that may wait for their isolation, per instance


def isolatable(error: BaseException | None, bug: bool, group) -> bool:
    """Whether the members of ``group``, which failed with ``error``, may be re-run alone."""
    if group.stage_failure is not None or group.solo:
        return False
    return bug or (isinstance(error, PipelineError) and error.kind is Kind.INVALID)


def backlog_full(error: PipelineError, waiting: int) -> PipelineError:
    """What the members of a failed group hear when ``waiting`` failed groups already wait to
    be isolated: the server is behind, not their input (UNAVAILABLE: retry)."""
    stage, model = getattr(error, "stage", ""), getattr(error, "model", "")
    where = f"stage '{stage}' (model '{model}')" if stage else "the pipeline"
    return PipelineError(
        Code.UNAVAILABLE,
        f"{where} failed on a batch in which one request may be bad, and {waiting} failed "
        "batches already wait to be re-run request by request: retry", stage=stage,
        model=model, kind=Kind.FAILED)


class Budget:
    """Re-runs isolation may make: ``capacity`` in reserve, ``EARNED_PER_SUCCESS`` more per
    request answered with outputs. Each re-run of a member spends one or does not happen."""

    def __init__(self, capacity: float) -> None:
        self.capacity = self.tokens = float(capacity)
        self._lock = threading.Lock()

    def earn(self, requests: int) -> None:
        with self._lock:
            self.tokens = min(self.capacity, self.tokens + EARNED_PER_SUCCESS * requests)

    def left(self) -> bool:
        return self.tokens >= 1

    def spend(self, members: int) -> bool:
        with self._lock:
            if members > self.tokens:
                return False
            self.tokens -= members
            return True


def _row_key(stage: str, inputs: dict, names: list[str], row: int) -> bytes:
    digest = hashlib.blake2b(stage.encode(), digest_size=16)
    for name in names:
        value = inputs[name]
        digest.update(f"\0{name}\0{value.dtype.str}\0{value.shape[1:]}\0".encode())
        digest.update(np.ascontiguousarray(value[row]).data)
    return digest.digest()


class Memo:
    """The rows a failed group's sub-requests got answered, by stage and the row's inputs: a
    member's re-run alone takes a sub-request's outputs from here when the group already got
    every one of its rows (``done``: the group's (stage, inputs, outputs); only stages whose
    model batches, host arrays only). Built on the isolation's thread, never on the normal
    path."""

    def __init__(self, done, batching: frozenset[str]) -> None:
        self.rows: dict[bytes, tuple[dict, int]] = {}
        for stage, inputs, outputs in done:
            if stage not in batching or not _host(inputs) or not _host(outputs):
                continue
            names = sorted(inputs)
            for row in range(len(inputs[names[0]]) if names else 0):
                self.rows.setdefault(_row_key(stage, inputs, names, row), (outputs, row))

    def outputs(self, stage: str, inputs: dict, wanted) -> dict | None:
        """``wanted`` outputs for the rows of ``inputs`` to ``stage``, or None unless every row
        was answered for the group."""
        if not self.rows or not inputs or not wanted or not _host(inputs):
            return None  # (no output names asks for every output: not known here)
        names = sorted(inputs)
        found = []
        for row in range(len(inputs[names[0]])):
            hit = self.rows.get(_row_key(stage, inputs, names, row))
            if hit is None or any(name not in hit[0] for name in wanted):
                return None
            found.append(hit)
        if not found:
            return None
        return {name: np.stack([outputs[name][row] for outputs, row in found])
                for name in wanted}


def _host(tensors: dict) -> bool:
    return all(isinstance(value, np.ndarray) and value.ndim >= 1 for value in tensors.values())


def lock_directory() -> Path:
    """Where lock files live: tmpfs when there is one (the container's /dev/shm)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class Exclusive:
    """Isolations of one orchestrator, one at a time across its instances (separate stub
    processes): ``flock`` on a file named by ``key`` (e.g. the model's directory). Only
    isolations take it; the kernel drops it with a process that dies."""

    def __init__(self, key: str, directory: Path | None = None) -> None:
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        self.path = (directory or lock_directory()) / f"bls-isolation-{digest}"
        self._local = threading.Lock()  # threads of this process take turns first

    @contextlib.contextmanager
    def held(self, until: float):
        """Yields True with the lock held, False if ``until`` (time.monotonic) passed first."""
        if not self._local.acquire(timeout=max(0.0, until - time.monotonic())):
            yield False
            return
        fd = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= until:
                        yield False
                        return
                    time.sleep(POLL_SECONDS)
            yield True
        finally:
            if fd is not None:
                os.close(fd)
            self._local.release()
