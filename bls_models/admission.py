"""Admission: how many requests of an orchestrator instance run at once.

At most ``max_inflight`` requests hold a slot (from the start of their group until answered and
their group has no sub-request out: the runtime releases it);
up to ``max_queued`` more wait here for one, first come first served, each answered when its
deadline passes. Beyond those ``execute`` waits for room, so further requests stay in Triton's
bounded queue — but only until the earliest deadline among those it holds. Waiting here rather
than in Triton's queue keeps deadlines on time under overload: Triton r24.10 rejects an expired
request only when its batcher reaches it, or in a sweep after 500 ms in which no instance came
free (core ``dynamic_batch_scheduler.cc``, ``WaitForPayloadSlotAvailable``).
Pure threading; the runtime answers and starts what this hands back.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class Admission:
    def __init__(self, max_inflight: int, max_queued: int) -> None:
        self.max_inflight, self.max_queued = max_inflight, max_queued
        self.running = 0
        self.queue: deque = deque()
        self._room = threading.Condition(threading.Lock())
        self._waiters = 0  # execute threads waiting for room

    def take(self, jobs, start, expire) -> list:
        """Admit ``jobs`` in order (``execute``'s thread): ``start(run)`` those that get a slot,
        together, before any wait; returns those that wait in the queue. A job that finds no
        room waits for it until its deadline; ``expire(job)`` answers one whose deadline passed
        first."""
        with self._room:  # the usual case: every job gets a slot
            if not self.queue and self.running + len(jobs) <= self.max_inflight:
                self.running += len(jobs)
                for job in jobs:
                    job.slot = True
                fits = True
            else:
                fits = False
        if fits:
            start(jobs)
            return []
        run, queued, waiting = [], [], deque(jobs)
        while waiting:
            with self._room:
                while waiting and self.running < self.max_inflight and not self.queue:
                    job = waiting.popleft()
                    self.running += 1
                    job.slot = True
                    run.append(job)
                while waiting and (self.running >= self.max_inflight or self.queue) \
                        and len(self.queue) < self.max_queued:
                    job = waiting.popleft()
                    job.queued = True
                    self.queue.append(job)
                    queued.append(job)
            if not waiting:
                break
            if run:  # they may be what frees room
                start(run)
                run = []
            with self._room:  # no room for the next one: wait (bounded) for a release
                if not (self.running < self.max_inflight and not self.queue) \
                        and len(self.queue) >= self.max_queued:
                    self._waiters += 1
                    try:
                        earliest = min(job.deadline.end for job in waiting)
                        self._room.wait(max(0.0, earliest - time.monotonic()))
                    finally:
                        self._waiters -= 1
            now = time.monotonic()
            for job in [job for job in waiting if job.deadline.end <= now]:
                waiting.remove(job)
                expire(job)
        if run:
            start(run)
        return queued

    def full(self) -> bool:
        """No slot is free (or requests wait for one): the instance is at capacity."""
        return self.running >= self.max_inflight or bool(self.queue)

    def release(self, jobs) -> list:
        """``jobs`` were answered: their slots, or their places in the queue, are free. Returns
        the queued jobs that now get a slot (to start, in order)."""
        with self._room:
            freed = False
            for job in jobs:
                if job.slot:
                    job.slot = False
                    self.running -= 1
                    freed = True
                elif job.queued:
                    job.queued = False
                    try:
                        self.queue.remove(job)  # at most max_queued long
                    except ValueError:
                        pass
                    freed = True
            if not freed:
                return []
            following = []
            while self.queue and self.running < self.max_inflight:
                queued = self.queue.popleft()
                queued.queued, queued.slot = False, True
                self.running += 1
                following.append(queued)
            if self._waiters:
                self._room.notify_all()
            return following
