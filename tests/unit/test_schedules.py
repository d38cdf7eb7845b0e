"""A property test over random schedules (``hypothesis``): arrivals in batches, deadlines,
cancellations, sub-model latencies, item-caused failures (a poisoned image fails its classifier
batch) and stage-wide failures (every request, with an error an item causes or one it does not),
as committed and with every answer sent (``return_within_ms`` 0) — over the r24.10-like fake
``pb_utils``.

For every schedule:
* exactly once: every request gets one answer, no rule of the fake is broken;
* on time: within its deadline plus ``SLACK``;
* innocent rows exact: a success carries exactly its own rows, and a request that is neither
  poisoned, cancelled, short of time nor in a sick stage succeeds;
* bounded: no stage gets more sub-requests than the requests that reach it plus the isolation
  budget (``isolation.Budget``: its reserve, one re-run per success); a stage that fails every
  request with an error no item causes, one per request at most.

``SCHEDULES`` examples per setup (default 20; the seed is fixed, so CI runs the same ones;
raise it to search further, e.g. ``SCHEDULES=300 pytest tests/unit/test_schedules.py``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bls_models.isolation import EARNED_PER_SUCCESS
from tests.helpers import SLACK, orchestrator
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import ITEM_ERROR, POISON, STAGE_ERROR, DirectedRowModels, code_of, exact, image_of

DEFAULT_DEADLINE_MS = 3000
STAGES = ("preprocess", "classifier", "embedder")


@dataclass(frozen=True)
class Planned:
    value: int
    deadline_ms: int | None   # None: the default deadline
    cancelled: bool
    delays_ms: tuple[int, int, int]  # preprocess, classifier, embedder

    @property
    def poisoned(self) -> bool:
        return self.value == POISON

    def request(self, index: int) -> Request:
        directives = ";".join(f"{stage}={ms}" for stage, ms in zip(STAGES, self.delays_ms) if ms)
        request = Request(image_of(self.value), request_id=f"q{index};{directives}",
                          timeout_us=(self.deadline_ms or 0) * 1000)
        if self.cancelled:
            request.sender.cancelled.set()
        return request


planned = st.builds(
    Planned,
    value=st.integers(20, 120) | st.just(POISON),
    deadline_ms=st.none() | st.integers(40, 600),
    cancelled=st.sampled_from([False] * 9 + [True]),
    delays_ms=st.tuples(st.integers(0, 20), st.integers(0, 50), st.integers(0, 50)),
)


@st.composite
def schedules(draw):
    """Execute calls (a pause, then 1-3 requests), and maybe a stage failing every request."""
    calls = draw(st.lists(st.tuples(st.integers(0, 30), st.lists(planned, min_size=1, max_size=3)),
                          min_size=1, max_size=12))
    sick = draw(st.sampled_from([None, ("embedder", STAGE_ERROR), ("classifier", ITEM_ERROR)]))
    return calls, sick


def at_most_two_poisoned(schedule) -> bool:
    calls, _ = schedule
    return sum(p.poisoned for _, batch in calls for p in batch) <= 2


SETUPS = {"committed": {}, "sent": {"return_within_ms": "0"}}


def run(schedule, setup: str) -> None:
    calls, sick = schedule
    pb = FakePbUtils(DirectedRowModels(sick=dict([sick]) if sick else None).models())
    orch = orchestrator(pb, **SETUPS[setup], default_deadline_ms=str(DEFAULT_DEADLINE_MS))
    pb.forbidden_locks.append(orch.backend.lock)
    requests, plans, sent = [], [], []
    try:
        for gap_ms, batch in calls:
            time.sleep(gap_ms / 1e3)
            made = [plan.request(len(requests) + i) for i, plan in enumerate(batch)]
            requests += made
            plans += batch
            sent += [time.monotonic()] * len(made)
            pb.execute(orch, made)
        for request in requests:
            assert request.sender.done.wait(DEFAULT_DEADLINE_MS / 1e3 + 2), "never answered"
        time.sleep(0.05)
    finally:
        pb.finalize(orch)
    assert pb.violations == []
    check(pb, requests, plans, sent, sick, setup, orch.budget.capacity)


def check(pb, requests, plans, sent, sick, setup, reserve) -> None:
    for request, plan, at in zip(requests, plans, sent):
        (response,) = request.answers  # exactly once
        deadline = (plan.deadline_ms or DEFAULT_DEADLINE_MS) / 1e3
        assert request.sender.answered_at - at < deadline + SLACK, (plan, code_of(response))
        code = code_of(response)
        if code == "SUCCESS":
            assert exact(response, plan.value), f"{plan}: rows not its own"
            assert not plan.poisoned and not sick, plan
        if plan.poisoned:
            assert code != "SUCCESS"
        if plan.cancelled:  # noticed once execute stops waiting for it (always, when "sent")
            assert code in (("CANCELLED", "UNAVAILABLE") if setup == "sent" else
                            ("CANCELLED", "UNAVAILABLE", "SUCCESS", "INVALID_ARG",
                             "INTERNAL")), (plan, code)
        innocent = not (plan.poisoned or plan.cancelled or sick or plan.deadline_ms)
        if innocent:
            assert code == "SUCCESS", (plan, code, response.error().message())
    calls = {stage: sum(1 for model, _ in pb.calls if model == stage) for stage in STAGES}
    successes = sum(1 for r in requests if code_of(r.answers[0]) == "SUCCESS")
    budget = reserve + EARNED_PER_SUCCESS * successes  # isolation.Budget
    for stage in STAGES:
        assert calls[stage] <= len(requests) + budget, (stage, calls, len(requests))
    if sick and sick[1] == STAGE_ERROR:
        assert calls[sick[0]] <= len(requests), (calls, len(requests))


PROFILE = settings(max_examples=int(os.environ.get("SCHEDULES", "20")), deadline=None,
                   derandomize=True, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                          HealthCheck.data_too_large])


@pytest.mark.parametrize("setup", list(SETUPS))
def test_every_schedule_answers_each_request_once_on_time_and_exactly(setup):
    @PROFILE
    @given(schedules().filter(at_most_two_poisoned))
    def property_(schedule):
        run(schedule, setup)

    property_()
