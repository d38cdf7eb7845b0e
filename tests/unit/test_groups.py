"""Per-batch orchestration: the requests of one ``execute`` batch run as groups (one run of the
pipeline on their stacked rows), and each keeps its own semantics — its own rows, its own
deadline, its own error, exactly one answer — over the r24.10-like fake ``pb_utils``.
"""

from __future__ import annotations

import time

import numpy as np

from bls_models import spec as S
from tests.helpers import SLACK, orchestrator, wait_answered
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import DirectedRowModels, code_of, exact, expected, image_of


def counting(run, counter: list):
    """``run``, recording the rows of each call."""
    async def counted(inputs, call, setup):
        counter.append(len(inputs["IMAGE"]))
        return await run(inputs, call, setup)
    return counted


def test_one_execute_batch_runs_the_pipeline_once_and_each_gets_its_own_rows(made):
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    runs = []
    orch.run = counting(orch.run, runs)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21, 22, 23)]
    pb.execute(orch, requests)
    for request, value in zip(requests, (20, 21, 22, 23)):
        (response,) = request.answers
        assert exact(response, value)
    assert runs == [4]
    assert sorted(model for model, _ in pb.calls) == ["classifier", "embedder", "preprocess"]
    assert {rid for _, rid in pb.calls} == {"r20,r21,r22,r23"}


def test_requests_with_different_deadlines_run_together_each_on_its_own(made):
    """A client timeout of its own does not split the batch: the group's sub-requests live as
    long as its latest member needs, and a member whose deadline passes first is answered then
    while the others go on."""
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    runs = []
    orch.run = counting(orch.run, runs)
    hasty = Request(image_of(20), request_id="hasty;classifier=300", timeout_us=150_000)
    patient = [Request(image_of(v), timeout_us=3_000_000 + v) for v in (21, 22)]
    started = time.monotonic()
    pb.execute(orch, [hasty, *patient])
    wait_answered([hasty, *patient])
    assert runs == [3]
    assert code_of(hasty.answers[0]) == "UNAVAILABLE"
    assert hasty.sender.answered_at - started < 0.15 + SLACK
    assert [code_of(r.answers[0]) for r in patient] == ["SUCCESS", "SUCCESS"]
    assert exact(patient[0].answers[0], 21) and exact(patient[1].answers[0], 22)


def seen_rows(models: dict, seen: dict) -> dict:
    """``models``, recording the value of each row each stage model is sent."""
    def recording(stage, model):
        def recorded(inputs, request):
            value = next(iter(inputs.values()))
            seen.setdefault(stage, []).append(sorted(int(v) for v in
                                                     value.reshape(len(value), -1)[:, 0]))
            return model(inputs, request)
        return recorded
    return {stage: recording(stage, model) for stage, model in models.items()}


def test_requests_asking_for_different_outputs_share_a_group_each_stage_only_its_rows(made):
    """Like the ensemble, a stage gets only the rows that asked for what it computes: the
    classifier those asking for CLASS_IDS or CLASS_PROBS, the embedder those asking for
    EMBEDDING; one group all the same, and each answered with exactly what it asked for."""
    seen: dict = {}
    pb = FakePbUtils(seen_rows(DirectedRowModels().models(), seen))
    made.append(orch := orchestrator(pb))
    runs = []
    orch.run = counting(orch.run, runs)
    asked = {20: ["EMBEDDING"], 21: [], 22: ["CLASS_IDS"], 23: ["CLASS_PROBS", "CLASS_IDS"]}
    requests = [Request(image_of(v), outputs=names) for v, names in asked.items()]
    pb.execute(orch, requests)
    assert runs == [4]
    assert seen == {"preprocess": [[20, 21, 22, 23]], "classifier": [[21, 22, 23]],
                    "embedder": [[20, 21]]}
    for request, (value, names) in zip(requests, asked.items()):
        (response,) = request.answers
        got = {t.name(): t.as_numpy() for t in response.output_tensors}
        assert sorted(got) == sorted(names or ["CLASS_IDS", "CLASS_PROBS", "EMBEDDING"])
        for name, array in expected(value).items():
            if name in got:
                assert np.array_equal(got[name], array), (value, name)


def test_a_stage_no_row_asked_for_gets_no_subrequest(made):
    seen: dict = {}
    pb = FakePbUtils(seen_rows(DirectedRowModels().models(), seen))
    made.append(orch := orchestrator(pb))
    asked = {20: ["CLASS_IDS", "CLASS_PROBS"], 21: ["CLASS_IDS", "CLASS_PROBS"],
             22: ["EMBEDDING"], 23: ["EMBEDDING"]}
    classes = [Request(image_of(v), outputs=asked[v]) for v in (20, 21)]
    pb.execute(orch, classes)
    embedding = [Request(image_of(v), outputs=asked[v]) for v in (22, 23)]
    pb.execute(orch, embedding)
    assert seen == {"preprocess": [[20, 21], [22, 23]], "classifier": [[20, 21]],
                    "embedder": [[22, 23]]}
    for request, value in zip(classes + embedding, (20, 21, 22, 23)):
        got = {t.name(): t.as_numpy() for t in request.answers[0].output_tensors}
        assert sorted(got) == asked[value]
        assert all(np.array_equal(array, expected(value)[name]) for name, array in got.items())


def test_a_group_bigger_than_the_stages_take_is_split(made):
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    runs = []
    orch.run = counting(orch.run, runs)
    requests = [Request({"IMAGE": np.full((3, *S.IMAGE.dims), 30 + i, np.uint8)})
                for i in range(8)]
    pb.execute(orch, requests)
    wait_answered(requests)
    assert all(code_of(r.answers[0]) == "SUCCESS" for r in requests)
    assert sum(runs) == 24 and max(runs) <= orch.group_rows


def test_a_member_cancelled_in_flight_is_answered_before_the_group_finishes(made):
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb, return_within_ms="50"))
    requests = [Request(image_of(v), request_id=f"q{v};preprocess=200") for v in (20, 21, 22)]
    pb.execute(orch, requests)
    time.sleep(0.1)
    requests[1].sender.cancelled.set()
    wait_answered(requests)
    codes = [code_of(r.answers[0]) for r in requests]
    assert codes == ["SUCCESS", "CANCELLED", "SUCCESS"]
    assert requests[1].sender.answered_at < min(requests[0].sender.answered_at,
                                               requests[2].sender.answered_at)


def test_a_client_timeout_above_max_deadline_is_answered_at_the_maximum(made):
    """The cap the supervisor relies on: a request whose client timeout is longer than
    max_deadline_ms is answered UNAVAILABLE at the maximum, naming it."""
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb, max_deadline_ms="200", default_deadline_ms="100"))
    slow = Request(image_of(20), request_id="slow;classifier=1000", timeout_us=5_000_000)
    started = time.monotonic()
    pb.execute(orch, [slow])
    wait_answered([slow])
    assert code_of(slow.answers[0]) == "UNAVAILABLE"
    assert "max_deadline_ms" in slow.answers[0].error().message()
    assert slow.sender.answered_at - started < 0.2 + SLACK
