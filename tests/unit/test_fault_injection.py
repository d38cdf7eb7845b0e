"""Fault injection: every pb_utils call the runtime makes raises — once, and always — during a
burst of requests over the r24.10-like fake (tests/unit/fake_pb_utils.py), with the committed
parameters.

The burst makes every call the runtime has: answers returned from ``execute`` (the normal
path), answers sent while the batch still runs (a deadline error, a cancellation,
and a success ready early while another group runs on the pool), isolation of a poisoned row and
a bug of the pipeline's own (its group INTERNAL), a request without its input, and error answers.

Each case asserts:
* the fault fired; ``execute`` never raised, no sender took two responses, nothing was asked of
  a closed sender, no lock was held across a round trip, nothing called pb_utils after
  finalize, no sub-request was sent for requests all answered already (the fake's rules);
* every request was answered exactly once, before ``execute`` returned, within its deadline plus
  ``SLACK``, with the answer it gets without the fault or INTERNAL (or, where the faulted call
  is what steers it, a success), never with the fault's text — except where r24.10 leaves no
  way to answer, which is then counted ``SEND_FAILED``: a ``send`` that raises has closed its
  sender first (``response_sender.cc``), and with ``InferenceResponse`` (or, for an error,
  ``TritonError``) always failing no response exists;
* every success carries exactly its own rows (``row_models.expect_exact``);
* the in-flight gauges are back to 0, and after finalize no thread of the orchestrator is left.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests import helpers
from tests.helpers import SLACK, counted
from tests.helpers import orchestrator_in_execute as orchestrator
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import POISON, DirectedRowModels, code_of, expect_exact, image_of

DEFAULT_DEADLINE = 2.0

CALLS = ("get_input_tensor_by_name", "as_numpy", "get_response_sender", "request_id", "timeout",
         "requested_output_names", "Tensor", "InferenceRequest", "exec",
         "get_output_tensor_by_name", "InferenceResponse", "TritonError", "send", "is_cancelled",
         "metric", "Logger")
# Calls that read a request: a fault there fails that request (INTERNAL) and drops the delay
# its id gave its group, so the requests whose failure was that delay may succeed.
READS = ("get_input_tensor_by_name", "as_numpy", "request_id", "timeout",
         "requested_output_names")
# The first such call is made for an early answer (or for an error answer): planned from the start.
RARE = ("TritonError", "Logger", "send", "get_response_sender", "is_cancelled")

BUGGY = 43  # the pipeline raises for this image: a bug of the orchestrator's own (logged)

KNOWN_BUGS: dict[tuple[str, str], str] = {}  # (call, how) -> why its case fails, as xfail


class Burst:
    """23 requests in 8 execute calls. Besides ordinary ones: a poisoned one (INVALID_ARG,
    isolated); in one group (its preprocess held 250 ms by ``late``), one whose 100 ms deadline
    passes (UNAVAILABLE, sent early) and one the client cancelled (CANCELLED, sent
    at the first check); one without its input (INVALID_ARG); one the pipeline fails
    on (INTERNAL, and its group-mate with it: a bug is never isolated); and two groups of 10
    rows in one call, the first with a 100 ms deadline and done at once (its success sent at
    that deadline), the other held 250 ms."""

    def __init__(self) -> None:
        self.batches: list[list[Request]] = []
        self.expected: dict[int, set[str]] = {}
        ordinary = iter(range(20, 40))

        def plain(count: int) -> list[Request]:
            values = [next(ordinary) for _ in range(count)]
            return [self.add(Request(image_of(v), request_id=f"r{v}"), "SUCCESS")
                    for v in values]

        self.batches.append(plain(3))
        self.batches.append([*plain(1),
                             self.add(Request(image_of(POISON), request_id="poisoned"),
                                      "INVALID_ARG"),
                             *plain(1)])
        cancelled = Request(image_of(41), request_id="cancelled")
        cancelled.sender.cancelled.set()
        self.batches.append([
            self.add(Request(image_of(40), request_id="slow", timeout_us=100_000), "UNAVAILABLE"),
            self.add(cancelled, "CANCELLED"),
            self.add(Request(image_of(42), request_id="late;preprocess=250"), "SUCCESS"),
            *plain(1)])
        mate = next(ordinary)  # grouped with the buggy one: a bug fails its group
        self.batches.append([
            self.add(Request({"PIXELS": np.zeros((1, 3), np.float32)}, request_id="unreadable"),
                     "INVALID_ARG"),
            self.add(Request(image_of(mate), request_id=f"r{mate}"), "INTERNAL"),
            self.add(Request(image_of(BUGGY), request_id="buggy"), "INTERNAL")])
        self.batches.append([
            self.add(Request(image_of(44, 10), request_id="early", timeout_us=100_000),
                     "SUCCESS"),
            self.add(Request(image_of(45, 10), request_id="held;classifier=250"), "SUCCESS")])
        self.batches += [plain(3), plain(3), plain(2)]

    def add(self, request: Request, code: str) -> Request:
        self.expected[id(request)] = {code}
        return request

    @property
    def requests(self) -> list[Request]:
        return [request for batch in self.batches for request in batch]

    def send(self, pb, orch) -> dict[int, float]:
        """Each batch to ``execute`` in turn; when each request was handed over."""
        sent = {}
        for batch in self.batches:
            now = time.monotonic()
            sent.update((id(request), now) for request in batch)
            pb.execute(orch, batch)
        return sent


def with_a_bug(run):
    async def buggy_for_one_image(inputs, call, setup):
        # A data-dependent bug: any row with this image makes the whole run raise (its group's
        # too: a bug is no row's fault, so the group is answered INTERNAL, never bisected).
        if (inputs["IMAGE"] == BUGGY).reshape(len(inputs["IMAGE"]), -1).all(axis=1).any():
            raise RuntimeError("a bug in the pipeline")
        return await run(inputs, call, setup)
    return buggy_for_one_image


def allowed(call: str, expected: set[str], request: Request, mates: list[Request]) -> set[str]:
    codes = expected | {"INTERNAL"}
    if call in READS and any(code_of(mate.answer) == "INTERNAL" for mate in mates
                             if mate.answers and ";" in mate._id):
        codes.add("SUCCESS")  # the delay a mate's id gave the group was lost with it
    if call == "is_cancelled" and "CANCELLED" in expected:
        codes.add("SUCCESS")  # a failed check counts as not cancelled
    return codes


def late_codes(request: Request, sent: dict[int, float]) -> set[str]:
    """UNAVAILABLE for a request with a deadline answered after it: a host too busy to finish
    its work in time ('early' has 100 ms for 10 rows; a loaded CI host once took longer), which
    the runtime must then answer so. Empty otherwise."""
    if request._timeout and request.sender.answered_at - sent[id(request)] >= request._timeout / 1e6:
        return {"UNAVAILABLE"}
    return set()


def lost_ok(call: str, how: str, expected: set[str]) -> bool:
    """Whether r24.10 leaves no way to answer this request (see the module docstring)."""
    if call == "send":
        return True
    if how == "always" and call == "InferenceResponse":
        return True
    return how == "always" and call == "TritonError" and expected != {"SUCCESS"}


@pytest.fixture(autouse=True)
def short_owed_wait(monkeypatch):
    """An answer owed past execute that r24.10 leaves no way to give (``lost_ok``) is waited for
    a second, not the fake's default."""
    from tests.unit import fake_pb_utils

    monkeypatch.setattr(fake_pb_utils, "OWED_WAIT", 1.0)


def cases():
    for call in CALLS:
        for how in ("once", "always"):
            bug = KNOWN_BUGS.get((call, how))
            marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
            yield pytest.param(call, how, id=f"{call}-{how}", marks=marks)


# With the committed max_owed_answers the burst's slow batches are owed: the keeper's
# get_response_sender and send are the calls faulted.
OWED_KNOWN: dict[tuple[str, str], str] = {}  # (call, how) -> why its case fails, as xfail


@pytest.mark.parametrize("bound", ["0", "committed"])
@pytest.mark.parametrize(("call", "how"), list(cases()))
def test_a_failing_pb_utils_call_leaves_every_request_answered_once_on_time(call, how, bound,
                                                                           request):
    if bound == "committed" and (call, how) in OWED_KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=OWED_KNOWN[(call, how)]))
    pb = FakePbUtils(DirectedRowModels().models())
    expect_exact(pb)
    make = orchestrator if bound == "0" else helpers.orchestrator
    orch = make(pb, default_deadline_ms=str(int(DEFAULT_DEADLINE * 1e3)))
    try:
        check_burst(pb, orch, call, how)
    finally:
        pb.finalize(orch)
    assert pb.violations == []
    assert not orch.metrics._thread.is_alive()
    assert not [t for t in orch.pool._threads if t.is_alive()]
    for gauge in ("bls_inflight_requests", "bls_inflight_subrequests"):
        assert counted(pb, orch, gauge) == 0, gauge
    lost = [request for request in pb.executed if not request.answers]
    for request in lost:  # r24.10 leaves no way to answer them: checked in check_burst
        pb.executed.remove(request)
    assert pb.check() == []


@pytest.mark.parametrize("how", ["once", "always"])
def test_a_failing_dlpack_hand_over_leaves_every_request_answered_once_on_time(how,
                                                                               monkeypatch):
    """The GPU profile's one call more: PIXELS goes to the next stages by
    ``Tensor.from_dlpack``. It failing, once and always, is held to the same checks."""
    monkeypatch.setattr(helpers, "profile", "gpu")
    test_a_failing_pb_utils_call_leaves_every_request_answered_once_on_time(
        "from_dlpack", how, "committed", None)


def check_burst(pb, orch, call: str, how: str) -> None:
    orch.run = with_a_bug(orch.run)
    pb.forbidden_locks.append(orch.backend.lock)
    burst = Burst()
    pb.faults.plan(call, how, after=0 if call in RARE else 5)
    sent = burst.send(pb, orch)
    assert pb.faults.raised[call] >= 1, f"the fault in {call} never fired"
    lost = 0
    mates = {id(request): batch for batch in burst.batches for request in batch}
    for request in burst.requests:
        expected = burst.expected[id(request)]
        assert request.answer_attempts <= 1
        if not request.answers:
            assert lost_ok(call, how, expected), f"{request._id} ({expected}) got no answer"
            lost += 1
            continue
        (response,) = request.answers
        code = code_of(response)
        deadline = (request._timeout / 1e6) or DEFAULT_DEADLINE
        codes = allowed(call, expected, request, mates[id(request)])
        assert code in codes | late_codes(request, sent), (request._id, code)
        assert request.sender.answered_at - sent[id(request)] < deadline + SLACK, request._id
        if code == "INTERNAL":
            assert "injected" not in response.error().message()
            assert "bug" not in response.error().message()
    # An owed answer is recorded by the keeper just after its send raised, which the fake
    # sees first: read the counts once nothing is owed (the keeper has recorded each).
    until = time.monotonic() + 2.0
    while orch.owed and time.monotonic() < until:
        time.sleep(0.01)
    assert counted(pb, orch, "bls_requests_total", code="SEND_FAILED") == lost
    assert counted(pb, orch, "bls_requests_total") == len(burst.requests)
    assert orch.inflight == 0


def test_the_burst_without_a_fault_meets_every_expectation_on_both_answer_paths():
    """The burst itself, with no fault: each request gets exactly what ``Burst`` says, and the
    early answers are sent (the cases above rely on those calls being made)."""
    pb = FakePbUtils(DirectedRowModels().models())
    expect_exact(pb)
    orch = orchestrator(pb, default_deadline_ms=str(int(DEFAULT_DEADLINE * 1e3)))
    orch.run = with_a_bug(orch.run)
    burst = Burst()
    try:
        sent = burst.send(pb, orch)
    finally:
        pb.finalize(orch)
    for request in burst.requests:
        expected = burst.expected[id(request)]
        assert code_of(request.answer) in expected | late_codes(request, sent), request._id
    # Sent through their senders: these three at least (each decided while its batch-mates run;
    # others too, as their groups end apart: an answer leaves when it is ready).
    sent_early = {request._id for request in burst.requests if request.sender.sent}
    assert {"cancelled", "early", "slow"} <= sent_early, sent_early
    for name in CALLS:
        assert pb.faults.calls[name] > 0, f"the burst never calls {name}"
    assert pb.check() == [] and threading.active_count() < 50
