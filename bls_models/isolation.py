"""Isolation: when a group fails with an error one request may cause, its members run alone, so
only the culprit hears of it.

The one policy: a failure one row may cause — a sub-model's ``Kind.INVALID`` (ONNX Runtime runs a
batch as one call, so one bad row fails all), or the run function's bug — makes each live member
run alone, one after the other, with the orchestrator's other instances' isolations held off
(``exclusive``), so a re-run meets no other re-run in the sub-model's batch. A member that fails
alone with a sub-model's ``INVALID`` runs once more at the end (the sub-model's batcher may have
put it with another request's bad row). Not after a failure no row causes (the group's
``stage_failure``). Re-runs are paid from a ``Budget`` that every successful request refills, so
a stage that fails every request is not amplified and the budget refills under any traffic.
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

from bls_models.errors import Kind, PipelineError

POLL_SECONDS = 0.002        # between attempts at the cross-instance lock
EARNED_PER_SUCCESS = 1.0    # re-runs a successful request earns
RESERVE_GROUPS = 4          # the budget's capacity, in full groups


def isolatable(error: BaseException | None, bug: bool, group) -> bool:
    """Whether the members of ``group``, which failed with ``error``, may be re-run alone."""
    if group.stage_failure is not None or group.solo:
        return False
    return bug or (isinstance(error, PipelineError) and error.kind is Kind.INVALID)


class Budget:
    """Re-runs isolation may make: ``capacity`` in reserve, ``EARNED_PER_SUCCESS`` more per
    request answered with outputs. A re-run of ``n`` members spends ``n`` or does not happen."""

    def __init__(self, capacity: float) -> None:
        self.capacity = self.tokens = float(capacity)
        self._lock = threading.Lock()

    def earn(self, requests: int) -> None:
        with self._lock:
            self.tokens = min(self.capacity, self.tokens + EARNED_PER_SUCCESS * requests)

    def spend(self, members: int) -> bool:
        with self._lock:
            if members > self.tokens:
                return False
            self.tokens -= members
            return True


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
