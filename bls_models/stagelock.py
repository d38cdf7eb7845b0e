"""Isolation across an orchestrator's instances: a reader-writer lock per stage, shared by every
process that serves the orchestrator (its instances are separate stub processes).

Coalescing isolates a failed group by re-sending its members one at a time, with the stage to
itself (coalescing.py). Within one instance the event loop guarantees that; but the other
instances keep sending, and the sub-model's dynamic batcher may put their sub-requests into one
batch with the culprit's re-send: the innocent then fail too (measured: 17 of 30 trials with two
instances and no cross-instance lock). So every coalesced sub-request holds the stage's lock
*shared* while it is out, and an isolation holds it *exclusive*.

``flock`` on two files per stage, writer first: a writer takes the ``gate`` exclusively (new
readers wait at it), then waits for the readers already out to leave ``stage``. Each
acquisition opens its own file description (flock locks belong to it, not to a thread), so
threads of one process exclude each other like processes do. The kernel drops the locks of a
process that dies. Every wait is bounded by the caller's deadline: a reader or writer that
cannot get the lock in time gives up (the sub-request is then answered with its deadline
error), so a stuck instance cannot hang the others beyond their deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from pathlib import Path

POLL_SECONDS = 0.001  # between attempts while the lock is taken (only during an isolation)


def lock_directory() -> Path:
    """Where the lock files live: tmpfs when there is one (the container's /dev/shm)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class StageLock:
    """The lock of one (orchestrator, stage). ``key`` names the orchestrator across its
    instances, e.g. its model directory: two servers of one repository share the lock, which
    costs them nothing but a wait during the other's isolations."""

    def __init__(self, key: str, stage: str, directory: Path | None = None) -> None:
        digest = hashlib.sha1(f"{key}\0{stage}".encode()).hexdigest()[:16]
        base = (directory or lock_directory()) / f"bls-isolation-{digest}"
        self.gate, self.stage = f"{base}.gate", f"{base}.stage"

    # -- readers: a sub-request thread, around exec() ------------------------------------------
    @contextlib.contextmanager
    def shared(self, expires: float):
        """Yields True once the lock is held shared, False if ``expires`` (time.monotonic)
        passed first: then do not send. An isolation's own re-sends do not come here: their
        process holds the lock exclusive (``SubRequests.send(isolating=True)``)."""
        gate = _take(self.gate, fcntl.LOCK_SH, expires, time.sleep)
        if gate is None:
            yield False
            return
        stage = _take(self.stage, fcntl.LOCK_SH, expires, time.sleep)
        os.close(gate)  # in the stage now: a writer may queue at the gate
        if stage is None:
            yield False
            return
        try:
            yield True
        finally:
            os.close(stage)

    # -- writers: the event loop, around an isolation ------------------------------------------
    @contextlib.asynccontextmanager
    async def exclusive(self, expires: float):
        """Yields True with the stage to this process (every instance's sub-requests that were
        out have come back), False if ``expires`` passed first."""
        gate = await _take_async(self.gate, fcntl.LOCK_EX, expires)
        if gate is None:
            yield False
            return
        try:
            stage = await _take_async(self.stage, fcntl.LOCK_EX, expires)
            if stage is None:
                yield False
                return
            try:
                yield True
            finally:
                os.close(stage)
        finally:
            os.close(gate)


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _try(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _take(path: str, mode: int, expires: float, sleep) -> int | None:
    """The path's lock in ``mode`` on a new file description, or None at ``expires``."""
    fd = _open(path)
    while not _try(fd, mode):
        if time.monotonic() >= expires:
            os.close(fd)
            return None
        sleep(POLL_SECONDS)
    return fd


async def _take_async(path: str, mode: int, expires: float) -> int | None:
    fd = _open(path)
    while not _try(fd, mode):
        if time.monotonic() >= expires:
            os.close(fd)
            return None
        await asyncio.sleep(POLL_SECONDS)
    return fd
