"""A bad request fails alone, with the shipped configuration, over the r24.10-like fake: the
per-request check before rows are stacked, and isolation of a failure one row may cause
(``isolation.bisect``: halves, each in a sub-model batch of its own, the group's answered
stages re-used). After each test the fake checks that every innocent got exactly its own rows
and no INVALID_ARG (tests/unit/row_models.expect_exact)."""

from __future__ import annotations

import numpy as np
import pytest

from bls_models import spec as S
from bls_models.errors import InvalidInput
from tests import helpers
from tests.helpers import orchestrator_in_execute as orchestrator
from tests.helpers import settled_metric
from tests.unit.fake_pb_utils import FakePbUtils, Request, SubModelError
from tests.unit.row_models import (
    ITEM_ERROR,
    POISON,
    STAGE_ERROR,
    DirectedRowModels,
    code_of,
    expect_exact,
    image_of,
)

# Under the committed (CPU) configs and the GPU profile: tests/unit/conftest.py.
pytestmark = pytest.mark.usefixtures("profile")

FULL = S.EMBEDDER.max_batch_size  # a padded attempt's rows


def fake(poisoned=("classifier",), **kwargs) -> FakePbUtils:
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=poisoned, **kwargs).models())
    expect_exact(pb, poisoned)
    return pb


def codes(requests) -> list[str]:
    return [code_of(request.answer) for request in requests]


def test_a_poisoned_row_fails_alone_and_the_others_get_their_own_rows(made):
    pb = fake(("embedder",))
    made.append(orch := orchestrator(pb))
    values = (20, POISON, 22, 23)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in values]
    pb.execute(orch, requests)
    assert codes(requests) == ["SUCCESS", "INVALID_ARG", "SUCCESS", "SUCCESS"]
    assert "stage 'embedder'" in requests[1].answer.error().message()
    assert settled_metric(pb, "bls_isolated_requests_total") == 4


def test_an_attempt_sends_only_the_stage_that_failed_in_a_full_batch_of_its_own(made):
    """The group's preprocess and classifier answered every row: the attempts take their rows
    from those answers and send only the embedder, each padded to a full batch (Triton's
    batcher adds nothing to it). Four rows, one bad: the whole group again (it may have shared
    a batch), then halves down to the bad one: 1 + 2 + 2 attempts."""
    pb = fake(("embedder",))
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21, POISON, 23)]
    pb.execute(orch, requests)
    embedder = [s for s in pb.sent if s.model == "embedder"]
    assert [s.rows for s in embedder] == [4] + [FULL] * 5
    if helpers.profile == "gpu":
        # The group's PIXELS stayed on the GPU, where no attempt can take rows of them: each
        # attempt runs every stage, in host memory, padded to a full batch (docs/orchestrator.md,
        # the ledger's isolation row).
        assert [s.rows for s in pb.sent[3:]] == [FULL] * 15
        assert [m for _, m in pb.output_memory[3:]] == [(pb.TRITONSERVER_MEMORY_CPU, 0)] * 15
        return
    assert [s.model for s in pb.sent].count("preprocess") == 1
    assert [s.model for s in pb.sent].count("classifier") == 1
    assert settled_metric(pb, "bls_isolation_reused_subrequests_total") == 2 * 5


def test_several_bad_rows_in_one_batch_each_fail_alone(made):
    pb = fake(("classifier", "embedder"))
    made.append(orch := orchestrator(pb))
    values = (POISON, 20, POISON, 21, 22, POISON, 23, 24)
    requests = [Request(image_of(v), request_id=f"r{i}") for i, v in enumerate(values)]
    pb.execute(orch, requests)
    assert codes(requests) == ["INVALID_ARG" if v == POISON else "SUCCESS" for v in values]


def test_a_full_group_is_not_re_run_whole(made):
    """A group whose failed sub-request filled a batch failed on its own rows: the search starts
    from its halves."""
    pb = fake(("embedder",))
    made.append(orch := orchestrator(pb))
    values = [POISON] + list(range(20, 20 + FULL - 1))
    requests = [Request(image_of(v), request_id=f"f{i}") for i, v in enumerate(values)]
    pb.execute(orch, requests)
    assert codes(requests) == ["INVALID_ARG"] + ["SUCCESS"] * (FULL - 1)
    embedder = [s.rows for s in pb.sent if s.model == "embedder"]
    assert embedder == [FULL] * (1 + 2 * 4), embedder  # log2(16) levels of two halves


def rejecting(stage: str, rejected: dict[str, int]) -> FakePbUtils:
    """The row models, with ``stage`` rejecting (ONNX Runtime's INVALID_ARGUMENT) the next
    ``rejected[name]`` sub-requests whose ids hold ``name``: as when the sub-model's batcher put
    them with another client's bad row."""
    models = DirectedRowModels().models()
    honest = models[stage]

    def sometimes(inputs, request):
        for name, left in rejected.items():
            if name in request.request_id and left:
                rejected[name] = left - 1
                raise SubModelError(ITEM_ERROR)
        return honest(inputs, request)

    models[stage] = sometimes
    pb = FakePbUtils(models)
    expect_exact(pb, ())
    return pb


def test_a_request_alone_rejected_in_a_shared_batch_is_tried_again_in_a_batch_of_its_own(made):
    pb = rejecting("classifier", {"unlucky": 1})
    made.append(orch := orchestrator(pb))
    unlucky = Request(image_of(20), request_id="unlucky")
    pb.execute(orch, [unlucky])
    assert codes([unlucky]) == ["SUCCESS"]
    assert [s.rows for s in pb.sent if s.model == "classifier"] == [1, FULL]


def test_a_request_alone_rejected_in_a_batch_of_its_own_is_the_cause(made):
    pb = fake(("classifier",))
    made.append(orch := orchestrator(pb))
    bad = Request(image_of(POISON), request_id="bad")
    pb.execute(orch, [bad])
    assert codes([bad]) == ["INVALID_ARG"]
    assert [s.rows for s in pb.sent if s.model == "classifier"] == [1, FULL]


def test_a_stage_failing_as_a_whole_is_never_re_run(made):
    """A group that met both a bad row (classifier) and a stage failing as a whole (embedder)
    hears the failure of the stage or the bad row's — no re-runs of a failure no row causes."""
    pb = FakePbUtils(DirectedRowModels(sick={"embedder": STAGE_ERROR}).models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v)) for v in (20, 21, 22)]
    pb.execute(orch, requests)
    assert codes(requests) == ["INTERNAL"] * 3
    assert settled_metric(pb, "bls_isolated_requests_total") == 0
    assert len(pb.sent) == 3


def test_a_stage_failing_as_a_whole_is_not_re_sent_while_a_bad_row_is_isolated():
    """The case the test above names: a bad row in the classifier and the embedder failing every
    request. Isolating cannot save anyone (each attempt meets the failing embedder again), and
    re-sending to a model that fails as a whole only adds to its load: it gets the group's one
    sub-request."""
    pb = FakePbUtils(DirectedRowModels(sick={"embedder": STAGE_ERROR}).models())
    orch = orchestrator(pb)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, POISON, 22)]
    try:
        pb.execute(orch, requests)
    finally:
        pb.finalize(orch)
    assert pb.check() == []
    assert codes([requests[0], requests[2]]) == ["INTERNAL"] * 2
    assert code_of(requests[1].answer) in ("INTERNAL", "INVALID_ARG")
    assert [s.model for s in pb.sent].count("embedder") == 1


def test_every_innocent_succeeds_under_a_steady_share_of_bad_requests(made):
    """One in ten requests poisoned, batches of 8, 40 batches: no innocent hears an error (no
    budget, no backlog to run out of), and an isolation costs a bounded number of attempts."""
    pb = fake(("embedder",))
    made.append(orch := orchestrator(pb))
    rng = np.random.default_rng(5)
    requests = []
    for batch in range(40):
        values = [POISON if rng.random() < 0.1 else int(rng.integers(20, 200))
                  for _ in range(8)]
        part = [Request(image_of(v), request_id=f"s{batch}-{i}") for i, v in enumerate(values)]
        requests += part
        pb.execute(orch, part)
    bad = sum(1 for r in requests if code_of(r.answer) == "INVALID_ARG")
    assert all(code_of(r.answer) == "SUCCESS" for r in requests
               if code_of(r.answer) != "INVALID_ARG")
    attempts = sum(1 for s in pb.sent if s.model == "embedder") - 40
    assert attempts <= bad * (1 + 2 * 3) + 40, (attempts, bad)  # per bad row: log2(8) levels


def raising_for(orch, value: int, error: Exception) -> None:
    """``orch``'s run function, raising ``error`` for any batch holding ``image_of(value)``."""
    pipeline = orch.run

    async def run(inputs, call, setup):
        if (inputs["IMAGE"] == value).reshape(len(inputs["IMAGE"]), -1).all(axis=1).any():
            raise error
        return await pipeline(inputs, call, setup)

    orch.run = run


@pytest.mark.parametrize(("error", "code"), [
    (ZeroDivisionError("a bug"), "INTERNAL"),
    (InvalidInput("image 9 is not allowed"), "INVALID_ARG"),
], ids=["a-bug", "invalid-input"])
def test_invalid_input_from_the_run_function_is_isolated_and_a_bug_is_not(made, error, code):
    """``InvalidInput`` raised for one row fails only its request (isolated); anything else the
    pipeline's own code raises is a bug, no row's fault: its group is INTERNAL, never re-run."""
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    raising_for(orch, 9, error)
    requests = [Request(image_of(v)) for v in (20, 9, 22)]
    pb.execute(orch, requests)
    if code == "INTERNAL":  # a bug's details stay in the log
        assert codes(requests) == ["INTERNAL"] * 3
        assert "ZeroDivisionError" not in requests[1].answer.error().message()
        assert any("ZeroDivisionError" in line for line in pb.log)
        assert settled_metric(pb, "bls_isolated_requests_total") == 0
        assert pb.calls == [], "a bug was re-run"
    else:
        assert codes(requests) == ["SUCCESS", code, "SUCCESS"]


def test_a_deadline_during_isolation_is_unavailable_never_another_rows_error(made):
    """The attempts are slow (a padded embedder takes 0.3 s) and the deadline 0.5 s: the
    innocents not reached in time hear the deadline (retryable), not the bad row's error."""
    models = DirectedRowModels(poisoned_stages=("embedder",)).models()
    embedder = models["embedder"]

    def slow_when_full(inputs, request):
        if len(inputs["PIXELS"]) == FULL:
            import time
            time.sleep(0.3)
        return embedder(inputs, request)

    models["embedder"] = slow_when_full
    pb = FakePbUtils(models)
    expect_exact(pb, ("embedder",))
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v), request_id=f"d{v}", timeout_us=500_000)
                for v in (20, 21, POISON, 23)]
    pb.execute(orch, requests)
    for request in requests:
        assert code_of(request.answer) in ("SUCCESS", "UNAVAILABLE", "INVALID_ARG")
        if code_of(request.answer) == "UNAVAILABLE":
            assert "deadline exceeded" in request.answer.error().message()


def test_the_per_request_check_runs_before_rows_are_stacked(made):
    """``tag_pipeline``'s token check is per request by nature: a bad request is refused in
    ``execute`` and the good ones run as one group, with no isolation and no bad row sent."""
    sent_tokens = []

    def tagger(inputs, request):
        tokens = inputs["TOKENS"]
        sent_tokens.append(tokens.copy())
        return {"TAGS": tokens % 7, "TAG_PROBS": np.ones(tokens.shape, np.float32)}

    pb = FakePbUtils({"tagger_tags": tagger})
    made.append(orch := orchestrator(pb, "tag_pipeline"))
    requests = []
    for i in range(8):
        tokens = np.full((1, S.TAGGER_SEQ_LEN), 100 + i, np.int64)
        if i % 2:
            tokens[0, 5] = S.TAGGER_VOCAB + i  # out of the vocabulary
        requests.append(Request({"TOKENS": tokens}, request_id=f"t{i}"))
    for index in range(0, 8, 4):  # two execute calls of 4
        pb.execute(orch, requests[index:index + 4])
    assert codes(requests) == ["SUCCESS", "INVALID_ARG"] * 4
    assert f"got 1 outside, e.g. {S.TAGGER_VOCAB + 1}" in requests[1].answer.error().message()
    assert all((tokens < S.TAGGER_VOCAB).all() for tokens in sent_tokens)
    assert [len(tokens) for tokens in sent_tokens] == [2, 2]  # the good ones, as one group
    assert settled_metric(pb, "bls_isolated_requests_total") == 0


def test_the_memo_never_answers_a_sub_request_that_names_no_outputs():
    from bls_models.isolation import Memo

    inputs = {"PIXELS": np.ones((2, 3), np.float32)}
    memo = Memo([("classifier", inputs, {"LOGITS": np.zeros((2, 4), np.float32)})])
    assert memo.outputs("classifier", inputs, []) is None
    assert memo.outputs("classifier", inputs, ["LOGITS"])["LOGITS"].shape == (2, 4)
    assert memo.outputs("embedder", inputs, ["LOGITS"]) is None
