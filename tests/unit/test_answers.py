"""How answers leave the orchestrator: returned from ``execute`` when ready within the hold
(one message to the server for the batch in r24.10), through each request's response sender
otherwise — each request exactly once either way, over the r24.10-like fake.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from bls_models import params
from bls_models.triton_runtime import Orchestrator
from tests.helpers import REPOSITORY, SLACK, committed_config, orchestrator, wait_answered
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import DirectedRowModels, exact, image_of


@pytest.fixture
def fake():
    return FakePbUtils(DirectedRowModels().models())


def test_answers_ready_within_the_hold_are_returned_from_execute(fake, made, long_hold):
    made.append(orch := orchestrator(fake))
    values = (20, 21, 22, 23)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in values]
    returned = fake.execute(orch, requests)
    assert returned is not None and len(returned) == len(requests)
    for request, value in zip(requests, values):
        assert request.returned is not None and request.sender.attempts == 0
        assert exact(request.returned, value)


def test_a_slow_group_goes_through_its_senders_and_does_not_hold_execute(fake, made):
    """Two groups in one batch (the slow request's 16 rows fill a group of their own): the fast
    one is returned, the slow one is sent once execute stops waiting."""
    made.append(orch := orchestrator(fake, return_within_ms="50"))
    fast = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21)]
    slow = Request({"IMAGE": np.repeat(image_of(22)["IMAGE"], orch.group_rows, axis=0)},
                   request_id="slow;classifier=300", outputs=["CLASS_IDS"])
    started = time.monotonic()
    fake.execute(orch, [fast[0], slow, fast[1]])
    held = time.monotonic() - started
    assert held < 0.05 + SLACK, f"execute held the batch {held:.3f} s"
    assert slow.sender.attempts == 0, "answered before its classifier finished"
    wait_answered([slow])
    assert slow.returned is None and len(slow.sender.sent) == 1
    for request, value in zip(fast, (20, 21)):
        assert request.returned is not None and request.sender.attempts == 0
        assert exact(request.returned, value)


def test_the_hold_follows_the_recent_batches(fake, made):
    """Until it has seen a few batches execute waits up to FIRST_HOLD_MS; then a few times what
    a batch of its rows is expected to take — the recent batches' median, or their median per
    row times its rows if longer — at least the floor, never more than return_within_ms."""
    made.append(orch := orchestrator(fake, return_within_ms="500"))
    assert orch.hold.seconds(1) == params.FIRST_HOLD_MS / 1e3
    for i in range(16):
        fake.execute(orch, [Request(image_of(20 + i), request_id="preprocess=10")])
    median = sorted(orch.hold.durations)[len(orch.hold.durations) // 2]
    assert median >= 0.01
    one = min(0.5, max(params.HOLD_FLOOR_MS / 1e3, params.HOLD_FACTOR * median))
    assert orch.hold.seconds(1) == pytest.approx(one)
    assert orch.hold.seconds(1) < 0.5
    # Batches of one row: a batch of 8 rows is expected to take 8 times as long.
    assert orch.hold.seconds(8) == pytest.approx(min(0.5, 8 * one))


def test_a_larger_batch_is_held_for_its_rows_not_detached(fake, made):
    """Over sub-models whose time grows with the rows (CPU models), a batch of 8 rows after
    batches of 1 is held for its expected time, not sent: answered from execute's list."""
    made.append(orch := orchestrator(fake, return_within_ms="1000"))
    for i in range(16):
        fake.execute(orch, [Request(image_of(20 + i), request_id="preprocess=10")])
    batch = [Request(image_of(40 + i), request_id="preprocess=10;classifier=40")
             for i in range(8)]
    fake.execute(orch, batch)
    wait_answered(batch)
    for request, value in zip(batch, range(40, 48)):
        assert request.returned is not None and request.sender.attempts == 0, request
        assert exact(request.returned, value)


def test_an_answer_at_the_end_of_the_hold_is_given_once_one_way_or_the_other(fake, made):
    """Answers finishing around the moment execute stops waiting (a 30 ms hold, sub-models of
    10 to 50 ms): each request is answered once, returned or sent, never both, never neither."""
    made.append(orch := orchestrator(fake, return_within_ms="30"))
    requests = []
    for trial in range(40):
        batch = [Request(image_of(20 + (trial + i) % 50),
                         request_id=f"t{trial}-{i};preprocess={10 + (trial * 7 + i * 13) % 41}",
                         outputs=[["EMBEDDING"], ["CLASS_IDS"]][i])  # one group each
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


def test_return_within_0_sends_every_answer(fake, made):
    made.append(orch := orchestrator(fake, return_within_ms="0"))
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21)]
    assert fake.execute(orch, requests) is None
    wait_answered(requests)
    for request, value in zip(requests, (20, 21)):
        assert request.returned is None and len(request.sender.sent) == 1
        assert exact(request.sender.sent[0], value)


def test_a_decoupled_orchestrator_is_refused_at_load(fake):
    """r24.10 refuses responses returned by a decoupled model's execute, and the orchestrator
    answers one response per request: a decoupled config fails its load, saying why."""
    config = committed_config("pipeline")
    config["model_transaction_policy"] = {"decoupled": True}
    with pytest.raises(params.ConfigError, match="decoupled"):
        Orchestrator(fake, {"model_name": "pipeline", "model_config": json.dumps(config),
                            "model_repository": str(REPOSITORY / "pipeline")}, "pipeline")
