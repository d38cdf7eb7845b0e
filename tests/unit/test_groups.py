"""Per-batch orchestration: the requests of one ``execute`` batch run as one group (one run of
the pipeline on their stacked rows), and each keeps its own semantics — its own rows, its own
error, exactly one answer — over the r24.10-like fake ``pb_utils``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from bls_models.errors import InvalidInput
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import POISON, DirectedRowModels, code_of, exact, image_of
from tests.unit.test_runtime import orchestrator, wait_answered

BAD = 7  # the run function rejects rows of this image (like tag_pipeline's token check)


def rejecting(run, counter: list):
    """``run``, counting its calls, raising InvalidInput when any row is image ``BAD``."""
    async def checked(inputs, call, setup):
        counter.append(len(inputs["IMAGE"]))
        rows = inputs["IMAGE"].reshape(len(inputs["IMAGE"]), -1)
        if (rows == BAD).all(axis=1).any():
            raise InvalidInput("image 7 is not allowed")
        return await run(inputs, call, setup)
    return checked


@pytest.fixture
def rows(made):
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    return pb, orch


def test_one_execute_batch_runs_the_pipeline_once_and_each_gets_its_own_rows(rows):
    pb, orch = rows
    runs = []
    orch.run = rejecting(orch.run, runs)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21, 22, 23)]
    pb.execute(orch, requests)
    wait_answered(requests)
    for request, value in zip(requests, (20, 21, 22, 23)):
        (response,) = request.answers
        assert exact(response, value)
    assert runs == [4]
    assert sorted(model for model, _ in pb.calls) == ["classifier", "embedder", "preprocess"]


def test_a_row_the_run_function_rejects_fails_alone(rows):
    pb, orch = rows
    runs = []
    orch.run = rejecting(orch.run, runs)
    values = (20, BAD, 22)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in values]
    pb.execute(orch, requests)
    wait_answered(requests)
    codes = [code_of(r.answers[0]) for r in requests]
    assert codes == ["SUCCESS", "INVALID_ARG", "SUCCESS"]
    assert "image 7 is not allowed" in requests[1].answers[0].error().message()
    assert exact(requests[0].answers[0], 20) and exact(requests[2].answers[0], 22)
    assert sorted(runs) == [1, 1, 1, 3]  # the group, then each member alone
    assert all(len(r.answers) == 1 for r in requests)


def test_a_poisoned_row_a_sub_model_rejects_fails_alone(rows):
    pb, orch = rows
    values = (20, POISON, 22)
    requests = [Request(image_of(v)) for v in values]
    pb.execute(orch, requests)
    wait_answered(requests)
    assert [code_of(r.answers[0]) for r in requests] == ["SUCCESS", "INVALID_ARG", "SUCCESS"]
    assert exact(requests[0].answers[0], 20) and exact(requests[2].answers[0], 22)


def test_requests_with_different_deadlines_run_apart(rows):
    pb, orch = rows
    runs = []
    orch.run = rejecting(orch.run, runs)
    requests = [Request(image_of(20), timeout_us=900_000), Request(image_of(21)),
                Request(image_of(22), timeout_us=900_000)]
    pb.execute(orch, requests)
    wait_answered(requests)
    assert all(code_of(r.answers[0]) == "SUCCESS" for r in requests)
    assert sorted(runs) == [1, 2]


def test_a_pipeline_rejecting_everything_stops_re_running_members_once_the_budget_is_spent(rows):
    """Isolation re-runs a failed group's members only while the budget allows: one group in
    reserve (group_rows), then half a re-run per member answered from a successful group."""
    pb, orch = rows
    runs = []
    orch.run = rejecting(orch.run, runs)
    batches = [[Request(image_of(BAD)) for _ in range(4)] for _ in range(12)]
    for batch in batches:
        pb.execute(orch, batch)
        wait_answered(batch)
    assert all(code_of(r.answers[0]) == "INVALID_ARG" for b in batches for r in b)
    alone = sum(1 for n in runs if n == 1)
    assert alone <= orch.group_rows, (alone, runs)
    assert len(runs) == 12 + alone


def test_a_group_bigger_than_the_stages_take_is_split(rows):
    pb, orch = rows
    runs = []
    orch.run = rejecting(orch.run, runs)
    requests = [Request({"IMAGE": np.full((3, *image_of(0)["IMAGE"].shape[1:]), 30 + i,
                                          np.uint8)}) for i in range(8)]
    pb.execute(orch, requests)
    wait_answered(requests)
    assert all(code_of(r.answers[0]) == "SUCCESS" for r in requests)
    assert sum(runs) == 24 and max(runs) <= orch.group_rows


def test_a_member_cancelled_in_flight_is_answered_before_the_group_finishes(made):
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v), request_id=f"q{v};preprocess=200") for v in (20, 21, 22)]
    pb.execute(orch, requests)
    time.sleep(0.1)
    requests[1].sender.cancelled.set()
    wait_answered(requests)
    codes = [code_of(r.answers[0]) for r in requests]
    assert codes == ["SUCCESS", "CANCELLED", "SUCCESS"]
    assert requests[1].sender.answered_at < min(requests[0].sender.answered_at,
                                               requests[2].sender.answered_at)
