"""A bad request fails alone, with the shipped configuration, over the r24.10-like fake: the
per-request check before rows are stacked, isolation of a failure one row may cause (several bad
rows in a batch included), its budget refilling under any traffic, no amplification of a stage
that fails everything, and isolations of two instances that never overlap."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import numpy as np
import pytest

from bls_models import spec as S
from bls_models.errors import InvalidInput
from bls_models.isolation import BACKLOG_GROUPS, Memo
from tests.helpers import committed_config, counted, orchestrator, wait_answered
from tests.unit.fake_pb_utils import FakePbUtils, Request, SubModelError
from tests.unit.row_models import ITEM_ERROR, POISON, STAGE_ERROR, DirectedRowModels, code_of, exact, image_of


def answered_codes(requests) -> list[str]:
    wait_answered(requests)
    return [code_of(r.answers[0]) for r in requests]


def run_poisoned_group(made):
    """Four images through the committed ``pipeline``, the second poisoned at the embedder:
    only that one fails (INVALID_ARG), and every other gets its own row."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))
    values = (20, POISON, 22, 23)
    requests = [Request(image_of(v), request_id=f"r{v}") for v in values]
    pb.execute(orch, requests)
    assert answered_codes(requests) == ["SUCCESS", "INVALID_ARG", "SUCCESS", "SUCCESS"]
    for request, value in zip(requests, values):
        if value != POISON:
            assert exact(request.answers[0], value)
    return pb, orch, requests


def test_a_poisoned_row_fails_alone_and_the_others_get_their_own_rows(made):
    pb, orch, requests = run_poisoned_group(made)
    assert "stage 'embedder'" in requests[1].answers[0].error().message()
    assert counted(pb, orch, "bls_isolated_requests_total") == 4


def test_a_member_run_alone_sends_only_the_stage_that_failed(made):
    """The group's preprocess and classifier answered every row: the members' re-runs take
    their rows from those answers (found by content) and send only the embedder, the stage that
    failed; the answers are still each row's own."""
    pb, orch, _ = run_poisoned_group(made)
    sent = [model for model, _ in pb.calls]
    assert sent.count("preprocess") == 1 and sent.count("classifier") == 1, sent
    assert sent.count("embedder") == 1 + 4 + 1  # the group, each alone, the bad one again
    reused = sum(counted(pb, orch, "bls_isolation_reused_subrequests_total", stage=stage)
                 for stage in ("preprocess", "classifier"))
    assert reused == 2 * 5


def test_several_bad_rows_in_one_batch_each_fail_alone(made):
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("classifier", "embedder")).models())
    made.append(orch := orchestrator(pb))
    values = (POISON, 20, POISON, 21, 22, POISON, 23, 24)
    requests = [Request(image_of(v), request_id=f"r{i}") for i, v in enumerate(values)]
    pb.execute(orch, requests)
    codes = answered_codes(requests)
    assert codes == ["INVALID_ARG" if v == POISON else "SUCCESS" for v in values], codes
    for request, value in zip(requests, values):
        if value != POISON:
            assert exact(request.answers[0], value), request._id


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
    assert answered_codes(requests) == ["SUCCESS", "INVALID_ARG"] * 4
    assert f"got 1 outside, e.g. {S.TAGGER_VOCAB + 1}" in requests[1].answers[0].error().message()
    assert all((tokens < S.TAGGER_VOCAB).all() for tokens in sent_tokens)
    assert [len(tokens) for tokens in sent_tokens] == [2, 2]  # the good ones, as one group
    assert counted(pb, orch, "bls_isolated_requests_total") == 0


def rejecting_classifier(rejected: dict[str, int], seen: list | None = None) -> FakePbUtils:
    """The row models, with a classifier that rejects (ONNX Runtime's INVALID_ARGUMENT) the
    next ``rejected[name]`` sub-requests whose ids hold ``name``; ``seen`` collects each
    sub-request's (ids, rows)."""
    models = DirectedRowModels().models()
    classifier = models["classifier"]

    def sometimes(inputs, request):
        if seen is not None:
            seen.append((request.request_id, len(inputs["PIXELS"])))
        for name, left in rejected.items():
            if name in request.request_id and left:
                rejected[name] = left - 1
                raise SubModelError(ITEM_ERROR)
        return classifier(inputs, request)

    models["classifier"] = sometimes
    return FakePbUtils(models)


def test_a_request_alone_that_a_sub_model_rejects_once_is_tried_once_more(made):
    """The sub-model's own batcher may have put a request with another client's bad row: a
    request that fails alone with INVALID runs once more; a truly bad one fails the second
    time too."""
    pb = rejecting_classifier({"unlucky": 1, "bad": 99})
    made.append(orch := orchestrator(pb))
    unlucky, bad = Request(image_of(20), request_id="unlucky"), Request(image_of(21),
                                                                         request_id="bad")
    pb.execute(orch, [unlucky])
    wait_answered([unlucky])  # its re-run is on the isolation thread: not beside bad's calls
    pb.execute(orch, [bad])
    assert answered_codes([unlucky, bad]) == ["SUCCESS", "INVALID_ARG"]
    assert exact(unlucky.answers[0], 20)
    assert [rid for model, rid in pb.calls if model == "classifier"] == ["unlucky"] * 2 + ["bad"] * 2


def test_the_last_try_alone_fills_a_batch_of_its_own(made):
    """A member whose first re-run alone is rejected (put with another client's bad row by the
    sub-model's batcher) is tried last in a batch Triton cannot add to: its rows repeated to the
    stage model's committed max_batch_size. Its answer is its own row, once."""
    rows_seen = []
    pb = rejecting_classifier({"r21": 2}, rows_seen)  # its group, then its first run alone
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v), request_id=f"r{v}") for v in (20, 21, 22)]
    pb.execute(orch, requests)
    assert answered_codes(requests) == ["SUCCESS"] * 3
    assert all(exact(request.answers[0], v) for request, v in zip(requests, (20, 21, 22)))
    full = orch.setup.max_rows["classifier"]
    assert full == committed_config("classifier")["max_batch_size"] > 1
    assert rows_seen == [("r20,r21,r22", 3), ("r20", 1), ("r21", 1), ("r22", 1), ("r21", full)]


def test_the_budget_refills_under_single_request_traffic(made):
    """Rounds of a batch with one bad row (isolated: 4 re-runs) between single good requests:
    every round's innocents succeed, long after a budget that only batches refill would be
    spent (its reserve is RESERVE_GROUPS groups)."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))
    rounds = 3 * int(orch.budget.capacity) // 4
    for round_ in range(rounds):
        batch = [Request(image_of(v), request_id=f"{round_}.{v}") for v in (20, POISON, 22, 23)]
        pb.execute(orch, batch)
        assert answered_codes(batch) == ["SUCCESS", "INVALID_ARG", "SUCCESS", "SUCCESS"], round_
        singles = [Request(image_of(30 + i), request_id=f"{round_}.s{i}") for i in range(2)]
        for single in singles:
            pb.execute(orch, [single])
        assert answered_codes(singles) == ["SUCCESS", "SUCCESS"]


def test_a_stage_rejecting_every_row_is_not_amplified_beyond_the_budget(made):
    """Every row rejected as invalid: re-runs stop once the reserve is spent, then each batch
    is answered with its error as it is."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("classifier",)).models())
    made.append(orch := orchestrator(pb))
    requests = []
    for index in range(40):
        batch = [Request(image_of(POISON), request_id=f"{index}.{i}") for i in range(4)]
        pb.execute(orch, batch)
        requests += batch
    assert set(answered_codes(requests)) == {"INVALID_ARG"}
    classifier = sum(1 for model, _ in pb.calls if model == "classifier")
    assert classifier <= 40 + orch.budget.capacity, classifier


def test_a_stage_failing_every_request_is_never_re_run(made):
    """An error no row causes (out of memory): each group's sub-request fails once and every
    member hears that failure promptly."""
    pb = FakePbUtils(DirectedRowModels(sick={"embedder": STAGE_ERROR}).models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(20 + i), request_id=f"r{i}") for i in range(40)]
    started = time.monotonic()
    for index in range(0, 40, 4):
        pb.execute(orch, requests[index:index + 4])
    assert set(answered_codes(requests)) == {"INTERNAL"}
    assert max(r.sender.answered_at for r in requests) - started < 2.0
    assert all("stage 'embedder'" in r.answers[0].error().message() for r in requests)
    assert sum(1 for model, _ in pb.calls if model == "embedder") == 10


def test_an_innocent_member_hears_the_stages_failure_not_another_members_invalid(made):
    """A group met both a bad row (classifier) and a stage failing as a whole (embedder): no
    re-runs, and every member hears the stage's failure."""
    pb = FakePbUtils(DirectedRowModels(sick={"embedder": STAGE_ERROR}).models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v)) for v in (20, POISON, 22)]
    pb.execute(orch, requests)
    assert answered_codes(requests) == ["INTERNAL"] * 3
    assert counted(pb, orch, "bls_isolated_requests_total") == 0


def raising_for(orch, value: int, error: Exception) -> None:
    """``orch``'s run function, raising ``error`` for any batch that holds the image of
    ``value`` (row_models.image_of)."""
    pipeline = orch.run

    async def run(inputs, call, setup):
        if (inputs["IMAGE"] == value).reshape(len(inputs["IMAGE"]), -1).all(axis=1).any():
            raise error
        return await pipeline(inputs, call, setup)

    orch.run = run


@pytest.mark.parametrize(("error", "code"), [
    (ZeroDivisionError("a bug"), "INTERNAL"),
    # A run function may still reject rows itself: its group is re-run member by member.
    (InvalidInput("image 9 is not allowed"), "INVALID_ARG"),
], ids=["a-bug", "invalid-input"])
def test_what_the_run_function_raises_for_one_row_fails_only_that_request(made, error, code):
    pb = FakePbUtils(DirectedRowModels().models())
    made.append(orch := orchestrator(pb))
    raising_for(orch, 9, error)
    requests = [Request(image_of(v)) for v in (20, 9, 22)]
    pb.execute(orch, requests)
    assert answered_codes(requests) == ["SUCCESS", code, "SUCCESS"]
    if code == "INTERNAL":  # a bug's details stay in the log
        assert "ZeroDivisionError" not in requests[1].answers[0].error().message()


def test_two_instances_never_isolate_at_the_same_time(made):
    """Two orchestrators of one model (its instances: one lock file) isolate a bad batch each at
    once: the one-row re-runs of one never overlap the other's, so no re-run meets another's
    bad row in a sub-model's batch."""
    lock = threading.Lock()
    spans: list[tuple[float, float, int]] = []
    rows = DirectedRowModels(poisoned_stages=("classifier",))
    classifier = rows.models()["classifier"]

    def timed(inputs, request):
        started = time.monotonic()
        try:
            time.sleep(0.01)
            return classifier(inputs, request)
        finally:
            with lock:
                spans.append((started, time.monotonic(), len(inputs["PIXELS"])))

    models = rows.models()
    models["classifier"] = timed
    fakes = [FakePbUtils(dict(models)) for _ in range(2)]
    instances = [orchestrator(pb) for pb in fakes]
    made.extend(instances)
    batches = [[Request(image_of(v), request_id=f"{n}.{v}") for v in (20, POISON, 22, 23)]
               for n in range(2)]
    threads = [threading.Thread(target=pb.execute, args=(orch, batch))
               for pb, orch, batch in zip(fakes, instances, batches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for batch in batches:
        assert answered_codes(batch) == ["SUCCESS", "INVALID_ARG", "SUCCESS", "SUCCESS"]
    alone = sorted((start, end) for start, end, n in spans if n == 1)
    assert len(alone) >= 8
    assert all(later[0] >= earlier[1] for earlier, later in zip(alone, alone[1:])), alone


def test_an_isolation_that_cannot_start_before_the_deadline_blames_no_one(made):
    """Another instance isolates (it holds the lock) past the members' deadline: every member
    hears that its deadline passed (UNAVAILABLE, retryable), none the poisoned row's INVALID_ARG.
    The clock's deadline timers are held back so that the isolation's own answer is the one
    checked (in a server the two race at the deadline)."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))
    at = orch.clock.at
    orch.clock.at = lambda when, callback, *args: at(
        when + (3600 if callback == orch._deadline else 0), callback, *args)
    held = os.open(orch.exclusive.path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        requests = [Request(image_of(v), request_id=f"r{v}", timeout_us=500_000)
                    for v in (20, POISON, 22, 23)]
        pb.execute(orch, requests)
        assert answered_codes(requests) == ["UNAVAILABLE"] * 4
    finally:
        os.close(held)
    for request in requests:
        assert "deadline exceeded in stage 'embedder'" in request.answers[0].error().message()
    assert len([rid for model, rid in pb.calls if model == "embedder"]) == 1  # no re-run


def test_a_burst_of_failed_groups_waiting_to_isolate_is_not_refused(made):
    """Six full groups, each with one poisoned row, fail while another instance isolates (it
    holds the lock): waiting reserves no budget, so all six are isolated in turn once the lock
    is free, and every innocent row succeeds (a reserve of RESERVE_GROUPS groups, spent up front,
    refused the fifth and sixth and told their innocents INVALID_ARG)."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))
    rows = orch.group_rows
    groups = 6
    assert groups * rows > orch.budget.capacity
    held = os.open(orch.exclusive.path, os.O_RDWR | os.O_CREAT, 0o600)
    batches = []
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        for n in range(groups):
            batch = [Request(image_of(POISON if i == 3 else 20 + i), request_id=f"{n}.{i}")
                     for i in range(rows)]
            pb.execute(orch, batch)
            batches.append(batch)
        until = time.monotonic() + 5
        while (time.monotonic() < until
               and counted(pb, orch, "bls_isolated_requests_total") < groups * rows):
            time.sleep(0.01)
    finally:
        os.close(held)
    for batch in batches:
        codes = answered_codes(batch)
        assert codes == ["INVALID_ARG" if i == 3 else "SUCCESS" for i in range(rows)], codes


def test_failed_groups_beyond_the_backlog_are_told_to_retry_and_hold_no_worker(made):
    """While another instance isolates (it holds the lock), failed groups wait on the isolation
    thread, not on the workers: a good batch is answered meanwhile. Beyond BACKLOG_GROUPS
    waiting, a failed group is answered at once UNAVAILABLE (retry), none INVALID_ARG; the ones
    that waited are isolated once the lock is free."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))
    waiting = BACKLOG_GROUPS
    held = os.open(orch.exclusive.path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        batches = []
        for n in range(waiting + 2):
            batch = [Request(image_of(20), request_id=f"{n}.good"),
                     Request(image_of(POISON), request_id=f"{n}.bad")]
            pb.execute(orch, batch)
            batches.append(batch)
        shed = batches[waiting:]
        assert [answered_codes(batch) for batch in shed] == [["UNAVAILABLE"] * 2] * 2
        assert "retry" in shed[0][0].answers[0].error().message()
        good = [Request(image_of(30 + i), request_id=f"g{i}") for i in range(2)]
        pb.execute(orch, good)
        assert answered_codes(good) == ["SUCCESS", "SUCCESS"]
        assert all(not r.answers for batch in batches[:waiting] for r in batch)
    finally:
        os.close(held)
    for batch in batches[:waiting]:
        assert answered_codes(batch) == ["SUCCESS", "INVALID_ARG"]


def test_members_whose_deadline_passes_during_isolation_give_their_token_back(made):
    """A slow first re-run outlives the others' deadlines: they are answered UNAVAILABLE by the
    clock and their re-runs never happen, so the budget gets their tokens back (a deadline is
    no stage's fault; left spent, deadlines under load would drain it and innocent rows would
    then hear the bad row's INVALID_ARG)."""
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))
    full = orch.budget.tokens
    requests = [Request(image_of(20), request_id="slow;embedder=600", timeout_us=5_000_000)]
    requests += [Request(image_of(v), request_id=f"r{v}", timeout_us=900_000)
                 for v in (POISON, 22, 23)]
    pb.execute(orch, requests)
    assert answered_codes(requests) == ["SUCCESS"] + ["UNAVAILABLE"] * 3
    until = time.monotonic() + 5
    while orch.isolations and time.monotonic() < until:
        time.sleep(0.01)
    assert orch.budget.tokens == full


def test_the_memo_never_answers_a_sub_request_that_names_no_outputs():
    """No output names asks a sub-model for every output: the group's answer may hold fewer."""
    pixels = np.arange(2 * 4, dtype=np.float32).reshape(2, 4)
    memo = Memo([("embedder", {"PIXELS": pixels}, {"EMBEDDING": pixels * 2})],
                frozenset({"embedder"}))
    row = {"PIXELS": pixels[1:]}
    assert np.array_equal(memo.outputs("embedder", row, ["EMBEDDING"])["EMBEDDING"],
                          pixels[1:] * 2)
    assert memo.outputs("embedder", row, []) is None
    assert memo.outputs("classifier", row, ["EMBEDDING"]) is None  # another stage
    assert memo.outputs("embedder", {"PIXELS": pixels[:1] + 1}, ["EMBEDDING"]) is None
