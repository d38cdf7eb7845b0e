"""The threads that run an orchestrator instance's groups and their sub-requests.

``InferenceRequest.exec`` blocks its thread until the sub-model answers and cannot be
interrupted (python_backend r24.10), so each sub-request out holds a thread. ``Workers`` is a
fixed number of *daemon* threads, started as needed, taking work in arrival order. Daemons,
because r24.10's backend waits for the stub process to exit without a bound
(``StubLauncher::WaitForStubProcess``) and a thread stuck in ``exec`` must not keep it alive;
``shutdown`` waits a bounded time and leaves such a thread behind.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback


class Workers:
    def __init__(self, count: int, name: str, log) -> None:
        self._count, self._name, self._log = count, name, log
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, function, *args) -> None:
        """Run ``function(*args)`` on a worker (raises once shut down)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: shut down")
            if not self._idle and len(self._threads) < self._count:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}-{len(self._threads)}")
                self._threads.append(thread)
                self._idle += 1
                thread.start()
            self._idle -= 1  # this item takes an idle thread (or waits for one)
        self._queue.put((function, args))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            function, args = item
            try:
                function(*args)
            except BaseException:  # noqa: BLE001 - work answers its own failures; this is the last resort
                self._log(f"{self._name}: work failed:\n{traceback.format_exc()}", error=True)
            del item, function, args  # nothing of the work outlives it on this thread
            with self._lock:
                self._idle += 1

    def shutdown(self, timeout: float) -> int:
        """Drop what is queued, let the threads finish what they run (up to ``timeout`` seconds
        in all) and end. Returns how many threads were still running then."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in threads:
            self._queue.put(None)
        give_up = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, give_up - time.monotonic()))
        return sum(thread.is_alive() for thread in threads)
