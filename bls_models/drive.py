"""Runs a pipeline's run function plainly: a ``Call`` is a blocking ``send`` on the thread that
awaits it; a ``Gather`` offers its branches to the bounded ``Pool`` and runs on this thread any
branch no thread took, so it never waits for a thread that is not coming. Anything else awaited
is thrown back as a ``TypeError``; ``Abandoned`` stops the run at once. No Triton here.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback

from bls_models.errors import PipelineError


class Abandoned(BaseException):
    """No request wants this run's answer any more: stop, issue no further sub-request."""


class Call:
    """``await call(stage, inputs, output_names, reduce=None)``: one sub-request."""

    __slots__ = ("stage", "inputs", "outputs", "reduce")

    def __init__(self, stage: str, inputs: dict, outputs, reduce=None) -> None:
        self.stage, self.inputs, self.outputs, self.reduce = stage, inputs, list(outputs), reduce

    def __await__(self):
        return (yield self)


class Gather:
    """``await gather_all(*awaitables)``: every branch to its end, then the first
    ``PipelineError`` among their failures (else the first other one), else their results."""

    __slots__ = ("awaitables",)

    def __init__(self, *awaitables) -> None:
        self.awaitables = list(awaitables)

    def __await__(self):
        return (yield self)


async def _awaiting(awaitable):
    return await awaitable


def drive(awaitable, send, pool: "Pool | None" = None):
    """Run ``awaitable`` to its end on this thread: its result, or its exception raised."""
    coroutine = awaitable if hasattr(awaitable, "throw") else _awaiting(awaitable)
    value = error = None
    try:
        while True:
            try:
                step = coroutine.throw(error) if error is not None else coroutine.send(value)
            except StopIteration as stop:
                return stop.value
            finally:  # no local keeps what is raised: its traceback holds this frame
                value = error = None
            try:
                if isinstance(step, Call):
                    value = send(step)
                elif isinstance(step, Gather):
                    value = _gather(step.awaitables, send, pool)
                else:
                    error = TypeError(f"a run function awaited {step!r}: it may await only "
                                      "call(...) and gather_all(...) (docs/extending.md)")
            except Exception as failure:  # noqa: BLE001 - handed to the run function
                error = failure
    finally:
        coroutine.close()


class _Branch:
    __slots__ = ("awaitable", "taken", "done", "result", "error")

    def __init__(self, awaitable) -> None:
        self.awaitable, self.taken = awaitable, False
        self.done = threading.Lock()  # released once it has run: a latch
        self.done.acquire()
        self.result = self.error = None

    def run(self, lock: threading.Lock, send, pool) -> None:
        with lock:
            if self.taken:
                return
            self.taken = True
        try:
            self.result = drive(self.awaitable, send, pool)
        except BaseException as failure:  # noqa: BLE001 - the gather raises it
            self.error = failure
        finally:
            self.awaitable = None
            self.done.release()


def _gather(awaitables, send, pool):
    branches = [_Branch(awaitable) for awaitable in awaitables]
    lock = threading.Lock()
    for branch in branches[1:]:
        if pool is None or not pool.offer(branch.run, lock, send, pool):
            break  # no thread to spare: this thread runs them
    for branch in branches:
        branch.run(lock, send, pool)
    for branch in branches:
        branch.done.acquire()
    errors = [b.error for b in branches if b.error is not None]
    results = [branch.result for branch in branches]
    for branch in branches:  # a branch's frame, in the error's traceback, holds the branch
        branch.error = branch.result = None
    if not errors:
        return results
    failure = next((e for e in errors if isinstance(e, Abandoned)), None) or next(
        (e for e in errors if isinstance(e, PipelineError)), errors[0])
    try:
        raise failure
    finally:  # no local keeps what is raised: its traceback holds this frame
        errors = failure = None


class Pool:
    """At most ``size`` daemon threads, started as needed. ``offer`` hands work to a free thread
    or refuses it (none is free, or shut down): nothing waits for a thread. Daemons: a thread
    blocked in a sub-model's ``exec`` (r24.10 cannot interrupt it) must not keep the stub
    process alive (``StubLauncher::WaitForStubProcess`` waits without a bound)."""

    def __init__(self, size: int, name: str, log) -> None:
        self.size, self._name, self._log = size, name, log
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle, self._closed = 0, False  # threads waiting for work, not promised any

    def offer(self, function, *args) -> bool:
        """Run ``function(*args)`` on a free thread of the pool; False if none is free."""
        with self._lock:
            if self._closed:
                return False
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self.size:
                thread = threading.Thread(target=self._serve, daemon=True,
                                          name=f"{self._name}-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            else:
                return False
        self._work.put((function, args))
        return True

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            function, args = item
            try:
                function(*args)
            except BaseException:  # noqa: BLE001 - work answers for itself; the last resort
                self._log(f"{self._name}: work failed:\n{traceback.format_exc()}", error=True)
            del item, function, args  # nothing of the work outlives it on this thread
            with self._lock:
                self._idle += 1

    def shutdown(self, timeout: float) -> int:
        """Let the threads finish what they run (up to ``timeout`` s in all) and end. Returns
        how many are still running then."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._work.put(None)
        give_up = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, give_up - time.monotonic()))
        return sum(thread.is_alive() for thread in threads)
