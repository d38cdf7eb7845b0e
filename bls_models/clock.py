"""One thread per orchestrator instance that runs callbacks at given times.

It keeps the promises about time that no other thread is there to keep: the deadlines of
requests ``execute`` no longer waits for, a stage's timeout, publishing the metrics. Callbacks
run one after another on this thread and must be short (a ``send`` at most); one that raises is
logged and the clock goes on. Timers are a heap: nothing grows but with what is scheduled.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import traceback


class Timer:
    __slots__ = ("when", "callback", "args", "cancelled", "clock")

    def __init__(self, when: float, callback, args, clock: "Clock") -> None:
        self.when, self.callback, self.args, self.clock = when, callback, args, clock
        self.cancelled = False

    def cancel(self) -> None:
        self.clock._cancel(self)


class Clock:
    def __init__(self, name: str, log) -> None:
        self._log = log
        self._heap: list[tuple[float, int, Timer]] = []
        self._cancelled = 0  # cancelled timers still in the heap (dropped when they are half)
        self._order = itertools.count()
        self._changed = threading.Condition(threading.Lock())
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-clock", daemon=True)
        self._thread.start()

    def at(self, when: float, callback, *args) -> Timer:
        """Run ``callback(*args)`` on this thread at ``when`` (``time.monotonic``)."""
        timer = Timer(when, callback, args, self)
        with self._changed:
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (when, next(self._order), timer))
            if earliest is None or when < earliest:
                self._changed.notify()
        return timer

    def _cancel(self, timer: Timer) -> None:
        with self._changed:
            if timer.cancelled:
                return
            timer.cancelled = True
            self._cancelled += 1
            if 2 * self._cancelled > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].cancelled]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def close(self, timeout: float) -> None:
        """Stop (timers not yet due are dropped) and wait up to ``timeout`` for the thread."""
        with self._changed:
            self._closed = True
            self._heap.clear()
            self._changed.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closed:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        timer = heapq.heappop(self._heap)[2]
                        if not timer.cancelled:
                            timer.cancelled = True  # done: a later cancel() is a no-op
                            break
                        self._cancelled -= 1
                        continue
                    self._changed.wait(self._heap[0][0] - now if self._heap else None)
                else:
                    return
            try:
                timer.callback(*timer.args)
            except BaseException:  # noqa: BLE001 - one failed callback must not stop the clock
                self._log(f"a timer failed:\n{traceback.format_exc()}", error=True)
