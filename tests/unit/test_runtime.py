"""The orchestrator runtime (``bls_models.triton_runtime.Orchestrator``) with its committed
parameters, a fake ``pb_utils`` and in-process sub-models: the normal path, deadlines, stage
timeouts, cancellation, groups, the pool's bound and shutdown, with no server. After each test
the fake checks the runtime's invariants (tests/unit/conftest.py)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from bls_models import spec as S
from bls_models import triton_runtime
from tests.helpers import SLACK, image_inputs, settled_metric, sub_models
from tests.helpers import orchestrator_in_execute as orchestrator
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import DirectedRowModels, code_of, expect_exact, image_of

# Under the committed (CPU) configs and the GPU profile: tests/unit/conftest.py.
pytestmark = pytest.mark.usefixtures("profile")


def rows_models(**kwargs) -> FakePbUtils:
    pb = FakePbUtils(DirectedRowModels(**kwargs).models())
    expect_exact(pb)
    return pb


def test_each_request_gets_its_own_rows_returned_in_one_message(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(1 + i % 5), request_id=f"r{i}") for i in range(30)]
    for start in range(0, 30, 7):  # several execute calls, as Triton batches them
        returned = pb.execute(orch, requests[start:start + 7])
        assert returned is not None and all(r is not None for r in returned)
    assert all(r.sender.attempts == 0 for r in requests), "nothing goes through a sender"
    assert settled_metric(pb, "bls_requests_total", code="SUCCESS") == 30
    assert pb.metric("bls_inflight_requests") == 0
    # Every sub-request carried the ids of the client requests whose rows it held, and the
    # requests of one execute call ran as one group: one sub-request per stage per call.
    assert {i for _, ids in pb.calls for i in ids.split(",")} == {f"r{i}" for i in range(30)}
    assert len(pb.calls) == 3 * 5


def test_the_normal_path_makes_no_round_trip_of_its_own(made):
    """No response sender, no ``send``, no ``is_cancelled``: the sub-requests and one message
    back are all (metrics go out every 0.2 s, not per request)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pb.execute(orch, [Request(image_inputs(), request_id=f"r{i}") for i in range(4)])
    for name in ("get_response_sender", "is_cancelled", "send"):
        assert pb.faults.calls[name] == 0, name
    assert pb.faults.calls["exec"] == 3


def test_a_deadline_both_branches_miss_is_answered_on_time_and_counted_once(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    request = Request(image_inputs(), request_id="classifier=0.6;embedder=0.6",
                      timeout_us=200_000)
    started = time.monotonic()
    pb.execute(orch, [request])
    elapsed = request.sender.answered_at - started
    error = request.answer.error()
    assert "deadline exceeded in stage 'classifier'" in error.message() \
        or "deadline exceeded in stage 'embedder'" in error.message()
    assert error.code() == pb.TritonError.UNAVAILABLE
    assert 0.2 <= elapsed < 0.2 + SLACK, elapsed  # sent at the deadline, while execute runs
    assert settled_metric(pb, "bls_deadline_exceeded_total") == 1
    abandoned = pb.metric("bls_abandoned_subrequests_total")
    assert abandoned == len([s for s in pb.sent if s.model != "preprocess"]) <= 2
    assert pb.metric("bls_subrequest_errors_total", kind="deadline") == abandoned
    time.sleep(0.6)  # the abandoned sub-requests finish, their results dropped, and are counted
    assert settled_metric(pb, "bls_abandoned_subrequests_completed_total") == abandoned


def test_an_answer_ready_early_leaves_by_its_deadline_not_with_the_batch(made):
    """Two groups in one execute (20 rows: more than a sub-request takes): the fast one's
    answer is sent at its deadline, with its outputs, while the slow one runs on."""
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    fast = Request(image_of(3, 10), request_id="fast", timeout_us=300_000)
    slow = Request(image_of(4, 10), request_id="slow;classifier=800")
    started = time.monotonic()
    pb.execute(orch, [fast, slow])
    assert fast.sender.sent and not fast.answer.has_error()
    assert fast.sender.answered_at - started < 0.3 + SLACK
    assert slow.returned is not None and not slow.answer.has_error()


def test_an_answer_finishing_at_its_deadline_is_given_once_returned_or_sent(made):
    """Groups finishing around their deadline (30 ms; a preprocess of 10 to 50 ms) beside a
    batch-mate that waits longer: the deadline's answer is sent at once, or ``execute`` returns
    the result, never both, never neither (the fake counts each request's answers), and both
    happen."""
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    requests = []
    for trial in range(40):
        request = Request(image_of(20 + trial), timeout_us=30_000,
                          request_id=f"t{trial};preprocess={10 + (trial * 17) % 41}")
        keeper = Request(image_of(90 + trial), request_id=f"k{trial}", timeout_us=2_000_000)
        pb.execute(orch, [request, keeper])
        assert not keeper.answer.has_error()
        requests.append(request)
    codes = [code_of(request.answer) for request in requests]
    assert set(codes) <= {"SUCCESS", "UNAVAILABLE"}, codes
    sent = [request for request in requests if request.sender.sent]
    assert all(code_of(request.answer) == "UNAVAILABLE" for request in sent)
    assert 0 < len(sent) < len(requests), f"{len(sent)} of {len(requests)} sent: one path only"


def test_a_cancelled_request_stops_before_its_next_stage_and_is_counted_once(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    request = Request(image_inputs(), request_id="preprocess=0.4")
    threading.Timer(0.05, request.sender.cancelled.set).start()  # the client goes away
    pb.execute(orch, [request])
    assert request.answer.error().code() == pb.TritonError.CANCELLED
    time.sleep(0.45)
    assert [model for model, _ in pb.calls] == ["preprocess"], "a later stage was still called"
    assert settled_metric(pb, "bls_cancelled_requests_total") == 1
    assert pb.metric("bls_requests_total", code="CANCELLED") == 1


def test_a_group_answered_between_two_calls_sends_nothing_more(made):
    """The deadline passes while the run function computes between preprocess and the
    classifier: the request is answered then, and its group makes no further sub-request (the
    fake reports one made for requests all answered already)."""
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pipeline = orch.run

    async def slow_between(inputs, call, setup):
        pixels = await call("preprocess", {"IMAGE": inputs["IMAGE"]}, ["PIXELS"])
        time.sleep(1.0)  # computing, no sub-request out
        await call("classifier", pixels, ["LOGITS"])
        return await pipeline(inputs, call, setup)

    orch.run = slow_between
    # 0.4 s: preprocess is sent well within it even on a loaded host (a 0.1 s deadline passed
    # before it once, with a second test worker busy); the deadline passes during the sleep.
    request = Request(image_inputs(), request_id="between", timeout_us=400_000)
    pb.execute(orch, [request])
    assert "deadline exceeded" in request.answer.error().message()
    assert [s.model for s in pb.sent] == ["preprocess"]


def test_a_batch_shorter_than_the_check_never_asks_about_cancellation(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    request = Request(image_inputs())
    request.sender.cancelled.set()  # Triton's batcher already dropped such requests
    pb.execute(orch, [request])
    assert request.sender.asked == 0 and not request.answer.has_error()


def test_a_failing_sub_model_fails_its_request_with_internal_naming_the_stage(made):
    pb = FakePbUtils(DirectedRowModels(sick={"embedder": "CUDA error: illegal address"})
                     .models())
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(i)) for i in range(3)]
    pb.execute(orch, requests)
    for request in requests:
        error = request.answer.error()
        assert error.code() == pb.TritonError.INTERNAL
        assert "stage 'embedder' (model 'embedder')" in error.message()
        assert "CUDA error" in error.message()
    assert [m for m, _ in pb.calls].count("embedder") == 1, "no request causes it: no re-run"


def test_a_stage_timeout_caps_its_sub_request(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, classifier_timeout_ms="100"))
    request = Request(image_inputs(), request_id="classifier=0.5")
    started = time.monotonic()
    pb.execute(orch, [request])
    elapsed = request.sender.answered_at - started
    assert 0.1 <= elapsed < 0.1 + SLACK
    assert "stage timeout of 100 ms" in request.answer.error().message()
    (sent,) = [s for s in pb.sent if s.model == "classifier"]
    assert sent.timeout_us <= 100_000


def test_a_sub_requests_timeout_is_the_time_left_when_it_is_sent(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    request = Request(image_inputs(), request_id="preprocess=0.3", timeout_us=2_000_000)
    arrived = time.monotonic()
    pb.execute(orch, [request])
    (sent,) = [s for s in pb.sent if s.model == "classifier"]
    assert sent.started - arrived > 0.25
    assert sent.timeout_us / 1e6 <= arrived + 2.0 - sent.started + 0.02


def test_a_stage_timeout_longer_than_the_time_left_does_not_extend_it(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, classifier_timeout_ms="900"))
    request = Request(image_inputs(), request_id="preprocess=0.4", timeout_us=1_000_000)
    arrived = time.monotonic()
    pb.execute(orch, [request])
    assert not request.answer.has_error()
    (sent,) = [s for s in pb.sent if s.model == "classifier"]
    assert sent.timeout_us / 1e6 <= arrived + 1.0 - sent.started + 0.02 < 0.65


def runs_counted(orch) -> list[int]:
    """The rows of each run of ``orch``'s run function, from now on."""
    runs, pipeline = [], orch.run

    async def counted(inputs, call, setup):
        runs.append(len(inputs["IMAGE"]))
        return await pipeline(inputs, call, setup)

    orch.run = counted
    return runs


def test_a_member_whose_deadline_passes_first_is_answered_then_while_its_group_goes_on(made):
    """A client timeout of its own does not split the batch: one run for the three, whose
    sub-requests live as long as the latest member needs; the hasty member is sent its deadline
    error at its deadline, and the others get their own rows when the group ends."""
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    runs = runs_counted(orch)
    hasty = Request(image_of(20), request_id="hasty;classifier=300", timeout_us=150_000)
    patient = [Request(image_of(v), request_id=f"p{v}", timeout_us=3_000_000) for v in (21, 22)]
    started = time.monotonic()
    pb.execute(orch, [hasty, *patient])
    assert runs == [3]
    assert code_of(hasty.answer) == "UNAVAILABLE" and hasty.sender.sent
    assert hasty.sender.answered_at - started < 0.15 + SLACK
    assert [code_of(r.answer) for r in patient] == ["SUCCESS", "SUCCESS"]
    assert all(r.returned is not None for r in patient)
    (classifier,) = [s for s in pb.sent if s.model == "classifier"]
    assert classifier.timeout_us > 2_000_000, "the group's sub-request had the hasty one's time"


def test_a_member_cancelled_in_flight_is_answered_before_its_group_finishes(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(v), request_id=f"q{v};preprocess=300") for v in (20, 21, 22)]
    threading.Timer(0.05, requests[1].sender.cancelled.set).start()
    pb.execute(orch, requests)
    finished = time.monotonic()
    assert [code_of(r.answer) for r in requests] == ["SUCCESS", "CANCELLED", "SUCCESS"]
    assert requests[1].sender.answered_at < finished - 0.1, "answered with the group"
    assert requests[0].returned is not None and requests[2].returned is not None


def test_requests_asking_for_different_outputs_share_a_group_each_stage_only_its_rows(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    classes = Request(image_of(1), request_id="c", outputs=["CLASS_IDS"])
    embedding = Request(image_of(2, 3), request_id="e", outputs=["EMBEDDING"])
    both = Request(image_of(3), request_id="b")
    pb.execute(orch, [classes, embedding, both])
    rows = {s.model: s.rows for s in pb.sent}
    assert rows == {"preprocess": 5, "classifier": 2, "embedder": 4}
    assert {t.name() for t in classes.answer.output_tensors} == {"CLASS_IDS"}


def test_a_stage_no_row_asked_for_gets_no_sub_request(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    pb.execute(orch, [Request(image_of(5), outputs=["EMBEDDING"])])
    assert [s.model for s in pb.sent] == ["preprocess", "embedder"]


def test_a_batch_bigger_than_a_sub_request_takes_is_run_as_several_groups(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    requests = [Request(image_of(i, 6), request_id=f"g{i}") for i in range(1, 5)]  # 24 rows
    pb.execute(orch, requests)
    assert max(s.rows for s in pb.sent) <= S.PREPROCESS.max_batch_size
    assert [s.model for s in pb.sent].count("preprocess") == 2


def test_a_client_timeout_above_max_deadline_is_answered_at_the_maximum(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb, max_deadline_ms="300", default_deadline_ms="300"))
    request = Request(image_inputs(), request_id="classifier=1.0", timeout_us=60_000_000)
    started = time.monotonic()
    pb.execute(orch, [request])
    assert request.sender.answered_at - started < 0.3 + SLACK
    assert "client timeout cut to max_deadline_ms of 300 ms" in request.answer.error().message()


def test_a_request_that_cannot_be_read_fails_alone_with_internal(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    pb.faults.plan("get_input_tensor_by_name", "once")
    broken, fine = Request(image_of(1)), Request(image_of(2), request_id="fine")
    pb.execute(orch, [broken, fine])
    error = broken.answer.error()
    assert error.code() == pb.TritonError.INTERNAL and "injected" not in error.message()
    assert not fine.answer.has_error()


def test_a_missing_input_is_the_clients_error_alone(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    missing, fine = Request({"OTHER": np.zeros((1, 2), np.uint8)}), Request(image_of(2))
    pb.execute(orch, [missing, fine])
    assert missing.answer.error().code() == pb.TritonError.INVALID_ARG
    assert "no input 'IMAGE'" in missing.answer.error().message()
    assert not fine.answer.has_error()


def test_a_response_that_cannot_be_built_is_internal_and_the_batch_goes_on(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))
    pb.faults.plan("Tensor", "once", after=3)  # the first answer's first output tensor
    requests = [Request(image_of(i), request_id=f"t{i}") for i in (1, 2)]
    pb.execute(orch, requests)
    codes = sorted(r.answer.error().code() if r.answer.has_error() else -1 for r in requests)
    assert codes == [-1, pb.TritonError.INTERNAL]


def test_a_send_that_raises_is_counted_and_execute_goes_on(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pb.faults.plan("send", "always")
    late = Request(image_inputs(), request_id="classifier=0.4", timeout_us=100_000)
    keeper = Request(image_inputs(), request_id="keeper", timeout_us=2_000_000)
    pb.execute(orch, [late, keeper])  # late is sent at its deadline: keeper still runs
    assert not keeper.answer.has_error()
    assert late.answer_attempts == 1 and late.answers == []  # r24.10: the sender is closed
    pb.faults.clear()
    fine = Request(image_inputs())
    pb.execute(orch, [fine])
    assert not fine.answer.has_error()
    assert settled_metric(pb, "bls_requests_total", code="SEND_FAILED") == 1
    pb.executed.remove(late)  # r24.10 leaves no way to answer it: not the runtime's fault


def test_the_pool_bounds_what_is_out_and_refuses_what_it_cannot_run(made):
    """A batch of three groups (10 rows each) and two pool threads: two groups run, the third,
    finding no thread free, is answered UNAVAILABLE at once (retryable); branches that find
    none run inline. No more sub-requests are ever out than threads."""
    pb = rows_models()
    made.append(orch := orchestrator(pb, subrequest_threads="2"))
    requests = [Request(image_of(v, 10), request_id=f"g{v};classifier=100") for v in (1, 2, 3)]
    started = time.monotonic()
    pb.execute(orch, requests)
    codes = [code_of(r.answer) for r in requests]
    assert codes == ["SUCCESS", "SUCCESS", "UNAVAILABLE"], codes
    assert "threads are busy" in requests[2].answer.error().message()
    assert requests[2].sender.answered_at - started < SLACK
    assert max(s.started for s in pb.sent) - started < 0.5  # nothing waited for a thread


def test_the_orchestrators_state_does_not_grow_with_traffic(made):
    pb = rows_models()
    made.append(orch := orchestrator(pb))

    def footprint():
        time.sleep(0.05)
        # Metrics are keyed by series, bounded by their labels (tests/unit/test_metrics.py).
        return (orch.pool._work.qsize(), len(orch.out), len(orch.abandoned), orch.inflight,
                len(orch.metrics._observed) <= 1 + 2 * len(orch.config.stages))

    def traffic(count):
        for i in range(count):
            value = 13 if i % 9 == 0 else 1 + i % 5  # some poisoned, isolated
            pb.execute(orch, [Request(image_of(value), request_id=f"s{count}-{i}"),
                              Request(image_of(2), request_id=f"t{count}-{i}",
                                      timeout_us=1_000_000 if i % 4 else 1000)])

    traffic(20)
    first = footprint()
    traffic(100)
    assert footprint() == first
    assert len(orch.pool._threads) <= orch.pool.size


def test_no_lock_is_held_across_a_round_trip_to_the_server(made):
    pb = FakePbUtils(sub_models())
    made.append(orch := orchestrator(pb))
    pb.forbidden_locks += [orch.backend.lock, orch.metrics._lock]
    slow = Request(image_inputs(), request_id="classifier=0.3", timeout_us=150_000)
    cancelled = Request(image_inputs(2), request_id="embedder=0.3")
    cancelled.sender.cancelled.set()
    pb.execute(orch, [slow, cancelled])
    time.sleep(0.5)


def test_every_known_series_exists_at_zero_before_any_request(made):
    pb = FakePbUtils(sub_models())
    made.append(orchestrator(pb))
    stub = ("stub_pid", str(os.getpid()))
    assert pb.metrics[("bls_requests_total", ("code", "UNAVAILABLE"), ("model", "pipeline"),
                       stub)] == 0
    assert ("bls_subrequest_errors_total", ("kind", "invalid"), ("model", "pipeline"),
            ("stage", "embedder"), stub) in pb.metrics


def test_shutdown_waits_for_the_sub_requests_out_and_then_makes_no_pb_utils_call():
    """The second of two groups (10 rows each) runs on the pool; its member is answered at its
    deadline and ``execute`` returns with its classifier still out: finalize waits for it."""
    pb = rows_models()
    orch = orchestrator(pb)
    first = Request(image_of(1, 10), request_id="first")
    second = Request(image_of(2, 10), request_id="second;classifier=500", timeout_us=100_000)
    pb.execute(orch, [first, second])
    assert len(orch.out) == 1
    started = time.monotonic()
    pb.finalize(orch)
    assert 0.2 < time.monotonic() - started < 1.0, "finalize waited for the sub-request"
    assert not orch.out and pb.check() == []
    assert second.answer.error().code() == pb.TritonError.UNAVAILABLE


def test_a_sub_request_still_out_after_finalize_makes_no_pb_utils_call(monkeypatch):
    monkeypatch.setattr(triton_runtime, "SHUTDOWN_DRAIN_SECONDS", 0.1)
    monkeypatch.setattr(triton_runtime, "SHUTDOWN_THREADS_SECONDS", 0.1)
    pb = rows_models()
    orch = orchestrator(pb)
    first = Request(image_of(1, 10), request_id="first")
    second = Request(image_of(2, 10), request_id="second;classifier=600", timeout_us=100_000)
    pb.execute(orch, [first, second])
    pb.finalize(orch)
    time.sleep(0.8)  # the classifier answers after finalize: nothing may touch pb_utils
    assert pb.violations == [] and pb.check() == []


@pytest.mark.parametrize("model", ["pipeline", "tag_pipeline", "digits_cascade"])
def test_a_decoupled_orchestrator_is_refused_at_load(model):
    from bls_models.params import ConfigError
    from tests.helpers import committed_config

    config = committed_config(model)
    config["model_transaction_policy"] = {"decoupled": True}
    import json

    from bls_models.triton_runtime import Orchestrator
    with pytest.raises(ConfigError, match="decoupled"):
        Orchestrator(FakePbUtils({}), {"model_name": model, "model_config": json.dumps(config),
                                       "model_repository": "model_repository/" + model}, model)
