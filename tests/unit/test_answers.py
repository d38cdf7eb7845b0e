"""How answers leave the orchestrator: returned from ``execute`` when they are ready within
``return_within_ms`` (one message to the server for the batch in r24.10), through each request's
response sender otherwise — each request exactly once either way, over the r24.10-like fake.
"""

from __future__ import annotations

import json
import time

import pytest

from bls_models import spec as S
from bls_models.triton_runtime import Orchestrator
from modelgen import configs
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import DirectedRowModels, exact, image_of
from tests.unit.test_runtime import REPOSITORY, orchestrator, wait_answered

SLACK = 0.25  # tests/live/support.SLACK: what a busy 2-core host may add to a promise about time


@pytest.fixture
def fake():
    return FakePbUtils(DirectedRowModels().models())


def test_answers_ready_within_the_hold_are_returned_from_execute(fake, made):
    made.append(orch := orchestrator(fake, coalesce="on", return_within_ms="2000"))
    values = (20, 21, 22, 23)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in values]
    returned = fake.execute(orch, requests)
    assert returned is not None and len(returned) == len(requests)
    for request, value in zip(requests, values):
        assert request.returned is not None and request.sender.attempts == 0
        assert exact(request.returned, value)
    assert fake.violations == []


def test_a_slow_answer_goes_through_its_sender_and_does_not_hold_execute(fake, made):
    # Coalescing off: the fast ones' classifier sub-request does not queue behind the slow one.
    made.append(orch := orchestrator(fake, coalesce="off", return_within_ms="50"))
    fast = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21)]
    # Its own deadline: a group of its own, 300 ms in the classifier.
    slow = Request(image_of(22), request_id="slow;classifier=300", timeout_us=5_000_000)
    started = time.monotonic()
    fake.execute(orch, [fast[0], slow, fast[1]])
    held = time.monotonic() - started
    assert held < 0.05 + SLACK, f"execute held the batch {held:.3f} s"
    assert slow.sender.attempts == 0, "answered before its classifier finished"
    wait_answered([slow])
    assert slow.returned is None and len(slow.sender.sent) == 1
    assert exact(slow.sender.sent[0], 22)
    for request, value in zip(fast, (20, 21)):
        assert request.returned is not None and request.sender.attempts == 0
        assert exact(request.returned, value)
    assert fake.violations == []


def test_an_answer_at_the_end_of_the_hold_is_given_once_one_way_or_the_other(fake, made):
    """Answers finishing around the moment execute stops waiting (a 30 ms hold, sub-models of
    10 to 50 ms): each request is answered once, returned or sent, never both, never neither."""
    made.append(orch := orchestrator(fake, coalesce="off", return_within_ms="30"))
    requests = []
    for trial in range(40):
        batch = [Request(image_of(20 + (trial + i) % 50),
                         request_id=f"t{trial}-{i};preprocess={10 + (trial * 7 + i * 13) % 41}",
                         timeout_us=5_000_000 + i)  # own deadlines: one group each
                 for i in range(2)]
        fake.execute(orch, batch)
        requests += batch
    wait_answered(requests)
    time.sleep(0.1)  # a second answer would come by now
    for request in requests:
        assert len(request.answers) == 1 and request.answer_attempts == 1
        assert not request.answers[0].has_error()
    returned = sum(request.returned is not None for request in requests)
    assert 0 < returned < len(requests), f"{returned} of {len(requests)} returned: one path only"
    assert fake.violations == []


def test_batch_gather_returns_every_answer_however_long(fake, made):
    made.append(orch := orchestrator(fake, coalesce="on", concurrency_mode="batch_gather",
                                     return_within_ms="0"))
    slow = Request(image_of(22), request_id="slow;classifier=200", timeout_us=5_000_000)
    fast = Request(image_of(20), request_id="r20")
    started = time.monotonic()
    returned = fake.execute(orch, [fast, slow])
    assert time.monotonic() - started >= 0.2
    assert returned is not None and all(r.sender.attempts == 0 for r in (fast, slow))
    assert exact(fast.returned, 20) and exact(slow.returned, 22)
    assert fake.violations == []


def test_a_decoupled_orchestrator_sends_every_answer(fake, made):
    """r24.10 refuses responses returned by a decoupled model's execute: all are sent."""
    spec = S.PIPELINE
    config = configs.config_dict(spec)
    config["model_transaction_policy"] = {"decoupled": True}
    made.append(orch := Orchestrator(fake, {
        "model_name": spec.name, "model_config": json.dumps(config),
        "model_repository": str(REPOSITORY / spec.name)}, "pipeline"))
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21)]
    assert fake.execute(orch, requests) is None
    wait_answered(requests)
    for request, value in zip(requests, (20, 21)):
        assert request.returned is None and len(request.sender.sent) == 1
        assert exact(request.sender.sent[0], value)
    assert fake.violations == []
