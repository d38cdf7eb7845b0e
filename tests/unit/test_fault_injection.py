"""Fault injection: every pb_utils call the runtime makes raises — once, and always — during a
burst of concurrent requests, in two setups: coalescing on with the committed
``return_within_ms`` (most answers returned from ``execute``, the slow one sent), and coalescing
off with ``return_within_ms`` 0 (every answer sent through its response sender). The fake
behaves like python_backend r24.10 where it matters: tests/unit/fake_pb_utils.py.

Each case asserts:
* ``execute`` never raised, no sender took two responses, nothing was asked of a closed sender,
  no lock was held across a round trip, nothing called pb_utils after finalize;
* every request was answered exactly once, within its deadline plus ``SLACK``, with the answer
  it would get without the fault or INTERNAL (or, where the faulted call is what steers it, a
  success) — except where r24.10 leaves no way to answer, which is then counted ``SEND_FAILED``:
  a ``send`` that raises has closed its sender first (``response_sender.cc``), and with
  ``InferenceResponse`` (or, for an error, ``TritonError``) always failing no response exists;
* every success carries exactly its own rows;
* slots, pending requests and the in-flight gauges are back to 0, and after finalize no thread
  or task of the orchestrator is left.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import POISON, DirectedRowModels, code_of, exact, image_of
from tests.unit.test_runtime import orchestrator

SLACK = 0.25  # tests/live/support.SLACK: what a busy 2-core host may add to a promise about time
DEFAULT_DEADLINE = 2.0

CALLS = ("get_input_tensor_by_name", "as_numpy", "get_response_sender", "request_id", "timeout",
         "requested_output_names", "Tensor", "InferenceRequest", "exec",
         "get_output_tensor_by_name", "InferenceResponse", "TritonError", "send", "is_cancelled",
         "metric", "Logger")


BUGGY = 43  # the pipeline raises for this image: a bug of the orchestrator's own (logged)


class Burst:
    """25 requests in 9 execute calls: 20 ordinary ones, one poisoned (INVALID_ARG), one whose
    classifier outlasts its 200 ms deadline (UNAVAILABLE), one the client cancelled
    (CANCELLED), one without its input (INVALID_ARG), one the pipeline fails on (INTERNAL)."""

    def __init__(self) -> None:
        self.requests, self.expected, self.values, self.deadlines = [], [], [], []
        for value in range(20, 40):
            self._add(Request(image_of(value), request_id=f"r{value}"), "SUCCESS", value)
        self._add(Request(image_of(POISON), request_id="poisoned"), "INVALID_ARG", POISON)
        self._add(Request(image_of(41), request_id="slow;classifier=400", timeout_us=200_000),
                  "UNAVAILABLE", 41, deadline=0.2)
        cancelled = Request(image_of(42), request_id="cancelled")
        cancelled.sender.cancelled.set()
        self._add(cancelled, "CANCELLED", 42)
        self._add(Request({"PIXELS": np.zeros((1, 3), np.float32)}, request_id="unreadable"),
                  "INVALID_ARG", None)
        self._add(Request(image_of(BUGGY), request_id="buggy"), "INTERNAL", BUGGY)
        order = np.random.default_rng(7).permutation(len(self.requests))
        for name in ("requests", "expected", "values", "deadlines"):
            setattr(self, name, [getattr(self, name)[i] for i in order])

    def _add(self, request, code, value, deadline=DEFAULT_DEADLINE) -> None:
        self.requests.append(request)
        self.expected.append(code)
        self.values.append(value)
        self.deadlines.append(deadline)

    def send(self, pb, orch) -> list[float]:
        sent = []
        for start in range(0, len(self.requests), 3):
            batch = self.requests[start:start + 3]
            sent += [time.monotonic()] * len(batch)
            pb.execute(orch, batch)
        return sent


def counted(pb, orch, family: str, **labels) -> float:
    """A series' value, published or not yet."""
    return pb.metric(family, **labels) + orch.metrics.pending(family, **labels)


def with_a_bug(run):
    async def buggy_for_one_image(inputs, call, setup):
        # A data-dependent bug: any row with this image makes the whole run raise (a group's
        # too: the runtime then runs each member alone, and only this one fails).
        if (inputs["IMAGE"] == BUGGY).reshape(len(inputs["IMAGE"]), -1).all(axis=1).any():
            raise RuntimeError("a bug in the pipeline")
        return await run(inputs, call, setup)
    return buggy_for_one_image


def allowed(call: str, how: str, expected: str, request: Request) -> set[str]:
    codes = {expected, "INTERNAL"}
    if call in ("request_id", "timeout") and "slow" in request._id:
        codes.add("SUCCESS")  # its id (the delay) or its timeout was lost with the fault
    if call == "is_cancelled" and expected == "CANCELLED":
        codes.add("SUCCESS")  # a failed check counts as not cancelled
    return codes


def lost_ok(call: str, how: str, expected: str) -> bool:
    """Whether r24.10 leaves no way to answer this request (see the module docstring)."""
    if call == "send":
        return True
    if how == "always" and call == "InferenceResponse":
        return True
    return how == "always" and call == "TritonError" and expected != "SUCCESS"


SETUPS = {"on": {"coalesce": "on"},  # return_within_ms as committed
          "off": {"coalesce": "off", "return_within_ms": "0"}}


@pytest.mark.parametrize("coalesce", ["on", "off"])
@pytest.mark.parametrize("how", ["once", "always"])
@pytest.mark.parametrize("call", CALLS)
def test_a_failing_pb_utils_call_leaves_every_request_answered_once_on_time(call, how, coalesce):
    pb = FakePbUtils(DirectedRowModels().models())
    orch = orchestrator(pb, **SETUPS[coalesce],
                        default_deadline_ms=str(int(DEFAULT_DEADLINE * 1e3)))
    try:
        check_burst(pb, orch, call, how)
    finally:
        pb.finalize(orch)
    assert pb.violations == []
    assert orch.loop.is_closed() and not orch.thread.is_alive()
    assert not [t for t in orch.subrequests.workers._threads if t.is_alive()]


def check_burst(pb, orch, call: str, how: str) -> None:
    orch.run = with_a_bug(orch.run)
    pb.forbidden_locks.append(orch.lock)
    burst = Burst()
    # Mid-burst for "once"; the first call for the rare ones (error answers, log lines, and
    # sends where answers are returned from execute: only the slow request is sent).
    rare = call in ("TritonError", "Logger") or (call == "send" and orch.config.return_within_ms)
    pb.faults.plan(call, how, after=0 if rare else 5)
    sent = burst.send(pb, orch)
    give_up = time.monotonic() + DEFAULT_DEADLINE + 2
    while (counted(pb, orch, "bls_requests_total") < len(burst.requests)
           and time.monotonic() < give_up):
        time.sleep(0.02)
    time.sleep(0.1)  # a second answer would come by now
    assert counted(pb, orch, "bls_requests_total") == len(burst.requests), "one was not answered"
    assert pb.faults.raised[call] >= 1, f"the fault in {call} never fired"

    lost = 0
    for request, expected, value, deadline, at in zip(burst.requests, burst.expected,
                                                      burst.values, burst.deadlines, sent):
        assert request.answer_attempts <= 1
        if not request.answers:
            assert lost_ok(call, how, expected), f"{request._id} ({expected}) got no answer"
            lost += 1
            continue
        (response,) = request.answers
        code = code_of(response)
        assert code in allowed(call, how, expected, request), (request._id, code)
        if call == "timeout":  # its timeout may be what was lost: the default deadline applies
            deadline = DEFAULT_DEADLINE
        assert request.sender.answered_at - at < deadline + SLACK, request._id
        if code == "SUCCESS":
            assert exact(response, value), f"{request._id} got rows not its own"
        elif code == "INTERNAL":
            assert "injected" not in response.error().message()
            assert "bug" not in response.error().message()
    assert counted(pb, orch, "bls_requests_total", code="SEND_FAILED") == lost

    responder = orch.responder
    assert responder.pending == set()
    room = responder.max_inflight + responder.max_queued
    taken = [responder.room.acquire(blocking=False) for _ in range(room)]
    assert all(taken), "a slot was never released"
    for _ in taken:
        responder.room.release()
    time.sleep(0.5)  # abandoned sub-requests come back (the slow classifier takes 0.4 s)
    for gauge in ("bls_inflight_requests", "bls_inflight_subrequests"):
        assert counted(pb, orch, gauge) == 0, gauge
