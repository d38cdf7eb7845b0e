"""The threads that run an orchestrator instance's sub-requests.

``InferenceRequest.exec`` blocks its thread until the sub-model answers and cannot be
interrupted (python_backend r24.10), so each sub-request in flight holds a thread. ``Workers`` is
a fixed-size pool of *daemon* threads, started as needed, with the part of
``concurrent.futures.ThreadPoolExecutor``'s interface the runtime uses: ``submit`` returns a
``concurrent.futures.Future`` whose ``cancel`` succeeds while the work is still queued.

Why not ``ThreadPoolExecutor`` itself: its threads are joined when the interpreter exits, so a
thread stuck in ``exec`` would keep the stub process from exiting after ``finalize``, and r24.10's
backend waits for that exit without a bound (``StubLauncher::WaitForStubProcess``). ``shutdown``
here waits a bounded time and leaves a stuck thread behind; the runtime makes sure such a thread
makes no pb_utils call once ``finalize`` has returned (``subrequests.SubRequests.close``).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time


class Workers:
    def __init__(self, count: int, name: str) -> None:
        self._count, self._name = count, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, function, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
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
        self._queue.put((future, function, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, function, args = item
            if future.set_running_or_notify_cancel():
                try:
                    result = function(*args)
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del item, future, args  # nothing of the work outlives it on this thread
            with self._lock:
                self._idle += 1

    def shutdown(self, timeout: float) -> list[threading.Thread]:
        """Cancel what is queued, let the threads finish what they run (up to ``timeout``
        seconds in all) and end. Returns the threads still running then."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        give_up = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, give_up - time.monotonic()))
        return [thread for thread in threads if thread.is_alive()]
