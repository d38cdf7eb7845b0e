"""A run function's coroutine, driven without an event loop.

A pipeline's ``async def run(inputs, call, setup)`` awaits two kinds of things: a sub-request
(what ``call(...)`` returns, a ``SubRequest``) and several awaitables at once (``gather``), or a
coroutine that itself awaits only those. ``Flow`` steps it until everything it waits for is a
sub-request and hands those to its caller, who sends them on any thread and resumes the flow
with each outcome. One flow is stepped by one thread at a time (its caller's lock); nothing here
knows Triton or threads. Anything else awaited (an asyncio future, ``asyncio.sleep``) is thrown
back into the coroutine as a ``TypeError`` naming it. Why not asyncio: docs/orchestrator.md.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Awaitable, Callable

from bls_models.errors import PipelineError


class SubRequest:
    """One sub-request a run function awaits: ``call(stage, inputs, output_names, reduce)``.
    Its sender fills ``result`` or ``error`` before resuming the flow with it."""

    __slots__ = ("stage", "inputs", "outputs", "reduce", "branch", "result", "error")

    def __init__(self, stage: str, inputs: dict, outputs, reduce=None) -> None:
        self.stage, self.inputs, self.outputs, self.reduce = stage, inputs, list(outputs), reduce
        self.branch = self.result = self.error = None

    def __await__(self):
        return (yield self)

    def __repr__(self) -> str:
        return f"SubRequest({self.stage!r})"


class Gather:
    """Awaits every one of ``awaitables`` to its end, then raises the first ``PipelineError``
    among their failures, else the first other exception, else returns their results in order.
    Unlike ``asyncio.gather``, no branch is left running when another fails."""

    __slots__ = ("awaitables",)

    def __init__(self, awaitables) -> None:
        self.awaitables = list(awaitables)

    def __await__(self):
        return (yield self)


def gather(*awaitables: Awaitable) -> Gather:
    return Gather(awaitables)


class _Branch:
    """A coroutine of the flow: the run function's own (``parent`` None), or a gathered one."""

    __slots__ = ("coroutine", "parent", "index")

    def __init__(self, coroutine, parent: "_Gathering | None", index: int) -> None:
        self.coroutine, self.parent, self.index = coroutine, parent, index


class _Gathering:
    __slots__ = ("branch", "outcomes", "left")

    def __init__(self, branch: _Branch, count: int) -> None:
        self.branch, self.outcomes, self.left = branch, [None] * count, count


async def _awaiting(awaitable):
    return await awaitable


def _coroutine(awaitable):
    return awaitable if hasattr(awaitable, "send") and hasattr(awaitable, "throw") \
        else _awaiting(awaitable)


class Flow:
    """One run of a run function. ``start()`` and ``resume()`` return the sub-requests it now
    waits for (possibly none while others are still out); once ``done``, ``result`` or
    ``error`` holds how it ended."""

    __slots__ = ("root", "live", "done", "result", "error")

    def __init__(self, coroutine) -> None:
        self.root = _Branch(coroutine, None, 0)
        self.live: set[_Branch] = {self.root}
        self.done = False
        self.result = None
        self.error: BaseException | None = None

    def start(self) -> list[SubRequest]:
        return self._step(self.root, None, None)

    def resume(self, sub: SubRequest) -> list[SubRequest]:
        """``sub`` came back (its ``result`` or ``error`` set by the sender)."""
        branch, sub.branch = sub.branch, None
        if branch is None or self.done:
            return []
        return self._step(branch, sub.result, sub.error)

    def close(self) -> None:
        """Stop every coroutine still suspended (an abandoned flow). Never raises."""
        for branch in list(self.live):
            try:
                branch.coroutine.close()
            except BaseException:  # noqa: BLE001 - a coroutine that refuses to close is dropped
                pass
        self.live.clear()
        self.done = True

    def _step(self, first: _Branch, value, error) -> list[SubRequest]:
        waiting: list[SubRequest] = []
        todo = [(first, value, error)]
        while todo:
            branch, value, error = todo.pop()
            try:
                if error is not None:
                    yielded = branch.coroutine.throw(error)
                else:
                    yielded = branch.coroutine.send(value)
            except StopIteration as stop:
                ended = (stop.value, None)
            except Exception as failure:  # noqa: BLE001 - the run function's failure is its outcome
                ended = (None, failure)
            else:
                if isinstance(yielded, SubRequest):
                    yielded.branch = branch
                    waiting.append(yielded)
                elif isinstance(yielded, Gather):
                    if not yielded.awaitables:
                        todo.append((branch, [], None))
                        continue
                    gathering = _Gathering(branch, len(yielded.awaitables))
                    for index in reversed(range(len(yielded.awaitables))):
                        child = _Branch(_coroutine(yielded.awaitables[index]), gathering, index)
                        self.live.add(child)
                        todo.append((child, None, None))
                else:
                    todo.append((branch, None, TypeError(
                        f"a run function awaited {yielded!r}: it may await only call(...) and "
                        "gather_all(...) (docs/extending.md)")))
                continue
            self.live.discard(branch)
            gathering = branch.parent
            if gathering is None:
                self.done = True
                self.result, self.error = ended
                continue
            gathering.outcomes[branch.index] = ended
            gathering.left -= 1
            if gathering.left == 0:
                errors = [e for _, e in gathering.outcomes if e is not None]
                failure = next((e for e in errors if isinstance(e, PipelineError)),
                               errors[0] if errors else None)
                todo.append((gathering.branch,
                             None if failure else [r for r, _ in gathering.outcomes], failure))
        return waiting


def run(coroutine, send: Callable[[SubRequest], object], threads: int = 0):
    """Drive ``coroutine`` to its end, ``send(sub)`` giving each sub-request's outputs (or
    raising its error): one after the other, or with ``threads`` on that many threads at once
    (gathered branches then overlap). Returns the run function's result or raises its error.
    For tests and the contract check; the runtime drives flows itself."""
    flow = Flow(coroutine)
    if threads <= 0:
        waiting = flow.start()
        while waiting:
            sub = waiting.pop(0)
            _send(send, sub)
            waiting += flow.resume(sub)
    else:
        lock, finished = threading.Lock(), threading.Event()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            def launch(subs):
                if flow.done:
                    finished.set()
                for sub in subs:
                    pool.submit(back, sub)

            def back(sub):
                _send(send, sub)
                with lock:
                    more = flow.resume(sub)
                launch(more)

            with lock:
                first = flow.start()
            launch(first)
            finished.wait()
    if flow.error is not None:
        raise flow.error
    return flow.result


def _send(send, sub: SubRequest) -> None:
    try:
        sub.result = send(sub)
    except Exception as failure:  # noqa: BLE001 - handed to the run function
        sub.error = failure
