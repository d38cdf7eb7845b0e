"""Fault injection: every pb_utils call the runtime makes raises — once, and always — during a
burst of requests, in two setups: as committed (answers returned from ``execute``; a request
slower than the hold goes through its sender) and with ``return_within_ms`` 0 (every answer
through its response sender). The fake behaves like python_backend r24.10 where it matters:
tests/unit/fake_pb_utils.py.

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
  of the orchestrator is left.
The late request (preprocess 500 ms: five times the hold before the runtime has timed a few
batches, and far longer than four times the fake's batches after) is what makes the calls of
the sender path (``get_response_sender``, ``is_cancelled``, ``send``) in the committed setup;
each case checks its fault fired.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.helpers import SLACK, counted, orchestrator
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import POISON, DirectedRowModels, code_of, exact, image_of

DEFAULT_DEADLINE = 2.0

CALLS = ("get_input_tensor_by_name", "as_numpy", "get_response_sender", "request_id", "timeout",
         "requested_output_names", "Tensor", "InferenceRequest", "exec",
         "get_output_tensor_by_name", "InferenceResponse", "TritonError", "send", "is_cancelled",
         "metric", "Logger")

BUGGY = 43  # the pipeline raises for this image: a bug of the orchestrator's own (logged)
SETUPS = {"committed": {},  # return_within_ms as committed
          "sent": {"return_within_ms": "0"}}


class Burst:
    """25 requests in 9 execute calls: 19 ordinary ones, one poisoned (INVALID_ARG), one whose
    classifier outlasts its 200 ms deadline (UNAVAILABLE), one slower than the hold that
    succeeds through its sender, one the client cancelled (CANCELLED once execute stops
    waiting for it; a success before), one without its input (INVALID_ARG), one the pipeline
    fails on (INTERNAL)."""

    def __init__(self, setup: str) -> None:
        self.requests, self.expected, self.values, self.deadlines = [], [], [], []
        for value in range(20, 39):
            self._add(Request(image_of(value), request_id=f"r{value}"), {"SUCCESS"}, value)
        self._add(Request(image_of(POISON), request_id="poisoned"), {"INVALID_ARG"}, POISON)
        self._add(Request(image_of(41), request_id="slow;classifier=400", timeout_us=200_000),
                  {"UNAVAILABLE"}, 41, deadline=0.2)
        self._add(Request(image_of(39), request_id="late;preprocess=500"), {"SUCCESS"}, 39)
        cancelled = Request(image_of(42), request_id="cancelled")
        cancelled.sender.cancelled.set()
        self._add(cancelled, {"CANCELLED"} if setup == "sent" else {"SUCCESS", "CANCELLED"}, 42)
        self._add(Request({"PIXELS": np.zeros((1, 3), np.float32)}, request_id="unreadable"),
                  {"INVALID_ARG"}, None)
        self._add(Request(image_of(BUGGY), request_id="buggy"), {"INTERNAL"}, BUGGY)
        order = np.random.default_rng(7).permutation(len(self.requests))
        for name in ("requests", "expected", "values", "deadlines"):
            setattr(self, name, [getattr(self, name)[i] for i in order])

    def _add(self, request, codes, value, deadline=DEFAULT_DEADLINE) -> None:
        self.requests.append(request)
        self.expected.append(codes)
        self.values.append(value)
        self.deadlines.append(deadline)

    def send(self, pb, orch) -> list[float]:
        sent = []
        for start in range(0, len(self.requests), 3):
            batch = self.requests[start:start + 3]
            sent += [time.monotonic()] * len(batch)
            pb.execute(orch, batch)
        return sent


def with_a_bug(run):
    async def buggy_for_one_image(inputs, call, setup):
        # A data-dependent bug: any row with this image makes the whole run raise (a group's
        # too: the runtime then runs each member alone, and only this one fails).
        if (inputs["IMAGE"] == BUGGY).reshape(len(inputs["IMAGE"]), -1).all(axis=1).any():
            raise RuntimeError("a bug in the pipeline")
        return await run(inputs, call, setup)
    return buggy_for_one_image


def allowed(call: str, expected: set[str], request: Request) -> set[str]:
    codes = expected | {"INTERNAL"}
    if call in ("request_id", "timeout") and "slow" in request._id:
        codes.add("SUCCESS")  # its id (the delay) or its timeout was lost with the fault
    if call == "is_cancelled" and "CANCELLED" in expected:
        codes.add("SUCCESS")  # a failed check counts as not cancelled
    return codes


def lost_ok(call: str, how: str, expected: set[str]) -> bool:
    """Whether r24.10 leaves no way to answer this request (see the module docstring)."""
    if call == "send":
        return True
    if how == "always" and call == "InferenceResponse":
        return True
    return how == "always" and call == "TritonError" and expected != {"SUCCESS"}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("how", ["once", "always"])
@pytest.mark.parametrize("call", CALLS)
def test_a_failing_pb_utils_call_leaves_every_request_answered_once_on_time(call, how, setup):
    pb = FakePbUtils(DirectedRowModels().models())
    orch = orchestrator(pb, **SETUPS[setup], default_deadline_ms=str(int(DEFAULT_DEADLINE * 1e3)))
    try:
        check_burst(pb, orch, call, how, setup)
    finally:
        pb.finalize(orch)
    assert pb.violations == []
    assert not [t for t in orch.workers._threads if t.is_alive()]
    assert not orch.clock._thread.is_alive()


def check_burst(pb, orch, call: str, how: str, setup: str) -> None:
    orch.run = with_a_bug(orch.run)
    pb.forbidden_locks.append(orch.backend.lock)
    burst = Burst(setup)
    # Mid-burst for "once"; the first call for the rare ones (error answers, log lines, and the
    # calls only a request execute stopped waiting for makes, as committed).
    rare = call in ("TritonError", "Logger") or (
        setup == "committed" and call in ("send", "get_response_sender", "is_cancelled"))
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
        assert code in allowed(call, expected, request), (request._id, code)
        if call == "timeout":  # its timeout may be what was lost: the default deadline applies
            deadline = DEFAULT_DEADLINE
        assert request.sender.answered_at - at < deadline + SLACK, request._id
        if code == "SUCCESS":
            assert exact(response, value), f"{request._id} got rows not its own"
        elif code == "INTERNAL":
            assert "injected" not in response.error().message()
            assert "bug" not in response.error().message()
    assert counted(pb, orch, "bls_requests_total", code="SEND_FAILED") == lost

    assert orch.answers.pending == set()
    give_up = time.monotonic() + 2.0  # abandoned sub-requests come back (0.5 s at most)
    while counted(pb, orch, "bls_inflight_subrequests") and time.monotonic() < give_up:
        time.sleep(0.05)
    for gauge in ("bls_inflight_requests", "bls_inflight_subrequests"):
        assert counted(pb, orch, gauge) == 0, gauge
    # A slot is held until its group's sub-requests are back, then released.
    give_up = time.monotonic() + 1.0
    while orch.admission.running and time.monotonic() < give_up:
        time.sleep(0.02)
    assert orch.admission.running == 0 and not orch.admission.queue, "a slot was never released"
