"""The runtime with coalescing on (``coalesce: "on"``), over a fake ``pb_utils`` and in-process
sub-models that compute each row from its own input: grouping, splitting, deadlines,
cancellation, isolation of a failed batch, exactly-once answers."""

from __future__ import annotations

import threading
import time

import numpy as np

from bls_models import pipelines
from bls_models import spec as S
from bls_models.metrics import FLUSH_SECONDS, HISTOGRAM_FLUSH_SECONDS
from tests.unit.fake_pb_utils import FakePbUtils, Request, SubModelError
from tests.unit.test_runtime import orchestrator, settled_metric, wait_answered

POISON = 13  # an image of this value fails its classifier batch, as a bad item fails an ORT batch


class RowModels:
    """preprocess, classifier and embedder whose every output row is a function of its input row
    alone; each sleeps ``delay`` per call and records its batch sizes."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay, self.batches, self.lock = delay, [], threading.Lock()

    def models(self) -> dict:
        return {"preprocess": self.preprocess, "classifier": self.classifier,
                "embedder": self.embedder}

    def _record(self, model, rows):
        with self.lock:
            self.batches.append((model, rows))
        time.sleep(self.delay)

    def preprocess(self, inputs, request):
        image = inputs["IMAGE"]
        self._record("preprocess", len(image))
        value = image.reshape(len(image), -1)[:, 0].astype(np.float32)
        return {"PIXELS": np.broadcast_to(value[:, None, None, None],
                                          (len(image), *S.PIXELS.dims)).copy()}

    def classifier(self, inputs, request):
        pixels = inputs["PIXELS"]
        self._record("classifier", len(pixels))
        value = pixels[:, 0, 0, 0]
        if (value == POISON).any():
            raise SubModelError("onnx runtime error 2: Non-zero status code returned while "
                                "running Gather node: indices element out of data bounds")
        return {"LOGITS": (np.arange(S.NUM_CLASSES, dtype=np.float32)[None, :]
                           * (1 + (value[:, None] % 7)))}

    def embedder(self, inputs, request):
        pixels = inputs["PIXELS"]
        self._record("embedder", len(pixels))
        return {"EMBEDDING": np.repeat(pixels[:, :1, 0, 0], S.EMBEDDING_DIM, axis=1)}

    @staticmethod
    def expected(value: int) -> dict[str, np.ndarray]:
        logits = np.arange(S.NUM_CLASSES, dtype=np.float32)[None, :] * (1 + value % 7)
        ids, probs = pipelines.softmax_top_k(logits)
        return {"CLASS_IDS": ids, "CLASS_PROBS": probs,
                "EMBEDDING": np.full((1, S.EMBEDDING_DIM), value, np.float32)}


def image_of(value: int) -> dict[str, np.ndarray]:
    return {"IMAGE": np.full((1, *S.IMAGE.dims), value, np.uint8)}


def outputs(response) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in response.output_tensors}


def coalescing(made, models: RowModels, **parameters):
    pb = FakePbUtils(models.models())
    made.append(orch := orchestrator(pb, coalesce="on", **parameters))
    return pb, orch


def behind_a_blocker(orch, group: list[Request], pause: float = 0.02) -> Request:
    """Start one request, then (its first sub-request out) send ``group`` in one execute."""
    blocker = Request(image_of(1))
    orch.pb.execute(orch, [blocker])
    time.sleep(pause)
    orch.pb.execute(orch, group)
    return blocker


def test_a_burst_is_grouped_and_each_request_gets_exactly_its_own_rows(made):
    models = RowModels()
    pb, orch = coalescing(made, models)
    requests = [Request(image_of(20 + v % 200), request_id=f"r{v}") for v in range(300)]
    for start in range(0, len(requests), 10):
        pb.execute(orch, requests[start:start + 10])
    wait_answered(requests, timeout=60)
    for index, request in enumerate(requests):
        (response,) = request.answers
        assert not response.has_error(), response.error().message()
        for name, value in RowModels.expected(20 + index % 200).items():
            np.testing.assert_array_equal(outputs(response)[name], value, err_msg=name)
    sizes = [rows for model, rows in models.batches if model == "classifier"]
    assert sum(sizes) == 300 and max(sizes) > 1 and max(sizes) <= S.CLASSIFIER.max_batch_size
    assert settled_metric(pb, "bls_requests_total", code="SUCCESS") == 300
    time.sleep(HISTOGRAM_FLUSH_SECONDS + FLUSH_SECONDS)  # histograms are published less often
    assert pb.metric("bls_coalesced_group_size_count", stage="classifier") == len(sizes)
    assert pb.metric("bls_coalesced_group_size_sum", stage="classifier") == 300
    assert pb.metric("bls_coalesced_group_size_bucket", stage="classifier",
                     le="+Inf") == len(sizes)


def test_alone_a_request_waits_for_no_company(made):
    models = RowModels(delay=0.0)
    pb, orch = coalescing(made, models)
    for value in range(5):
        request = Request(image_of(value))
        pb.execute(orch, [request])
        wait_answered([request])
    assert [rows for _, rows in models.batches] == [1] * 15


def test_a_poisoned_request_fails_alone_and_its_group_gets_exact_results(made):
    models = RowModels(delay=0.05)
    pb, orch = coalescing(made, models, coalesce_in_flight="1")
    group = [Request(image_of(v)) for v in (2, POISON, 4, 5)]
    blocker = behind_a_blocker(orch, group)  # the four go together
    wait_answered([blocker, *group], timeout=20)
    for value, request in zip((2, POISON, 4, 5), group):
        (response,) = request.answers
        if value == POISON:
            assert response.error().code() == pb.TritonError.INVALID_ARG
            assert "stage 'classifier'" in response.error().message()
        else:
            assert not response.has_error()
            np.testing.assert_array_equal(outputs(response)["EMBEDDING"],
                                          RowModels.expected(value)["EMBEDDING"])
    classifier = [rows for model, rows in models.batches if model == "classifier"]
    assert 4 in classifier and classifier.count(1) >= 4, classifier  # the group, then singly
    assert settled_metric(pb, "bls_requests_total", code="INVALID_ARG") == 1


def test_a_short_deadline_in_a_group_is_answered_on_time_and_the_long_ones_succeed(made):
    models = RowModels(delay=0.3)
    pb, orch = coalescing(made, models, coalesce_in_flight="1")
    short = Request(image_of(2), timeout_us=150_000)
    long = [Request(image_of(v), timeout_us=5_000_000) for v in (3, 4)]
    started = time.monotonic()
    blocker = behind_a_blocker(orch, [short, *long])
    wait_answered([short])
    elapsed = time.monotonic() - started
    wait_answered(long, timeout=20)
    assert short.answers[0].error().code() == pb.TritonError.UNAVAILABLE
    assert elapsed < 0.15 + 0.25  # tests/live/support.py SLACK
    assert all(not r.answers[0].has_error() for r in long)
    assert settled_metric(pb, "bls_deadline_exceeded_total") == 1
    assert all(len(r.answers) == 1 for r in (blocker, short, *long))


def test_a_cancelled_member_leaves_before_the_next_stage_and_its_group_finishes(made):
    # The blocker's preprocess gives its slot back after FIRST_STRAGGLER_SECONDS (0.1 s): the
    # three are then in preprocess together, from about 0.1 s to 0.5 s.
    models = RowModels(delay=0.4)
    pb, orch = coalescing(made, models, coalesce_in_flight="1")
    group = [Request(image_of(v)) for v in (2, 3, 4)]
    blocker = behind_a_blocker(orch, group)
    time.sleep(0.25)  # the three are in preprocess together
    group[1].sender.cancelled.set()
    wait_answered([blocker, *group], timeout=20)
    assert group[1].answers[0].error().code() == pb.TritonError.CANCELLED
    assert not group[0].answers[0].has_error() and not group[2].answers[0].has_error()
    assert settled_metric(pb, "bls_cancelled_requests_total") == 1
    assert all(len(r.answers) == 1 for r in (blocker, *group))
    # The group's rows go on together (the cancelled member's too: a run function's rows are
    # its own to arrange), once: blocker + the group's three.
    later = [rows for model, rows in models.batches if model == "classifier"]
    assert sum(later) == 4, later


def test_inputs_kept_on_the_gpu_are_sent_alone(made):
    """With gpu_tensors on, PIXELS reaches the classifier as a DeviceTensor, which cannot be
    concatenated: that sub-request bypasses the stage's coalescer; numpy inputs still use it."""
    import asyncio

    from bls_models.deadline import Deadline
    from bls_models.responder import Job
    from bls_models.subrequests import DeviceTensor, Outcome

    pb, orch = coalescing(made, RowModels(delay=0.0))
    subrequests, routes = orch.subrequests, []
    logits = Outcome(outputs={"LOGITS": np.zeros((1, S.NUM_CLASSES), np.float32)})

    async def send(stage, parts, output_names):
        routes.append(("alone", stage))
        return [logits], False

    async def submit(part, output_names):
        routes.append(("coalesced", "classifier"))
        return logits

    subrequests.send = send
    subrequests.coalescers["classifier"].submit = submit
    job = Job(Deadline.for_request(0, 5000), time.monotonic(), request_id="gpu")
    job.cancelled = False
    for pixels in (DeviceTensor(object()), np.zeros((1, *S.PIXELS.dims), np.float32)):
        asyncio.run_coroutine_threadsafe(
            subrequests.call(job, "classifier", {"PIXELS": pixels}, ["LOGITS"]),
            orch.loop).result(timeout=10)
    assert routes == [("alone", "classifier"), ("coalesced", "classifier")]
