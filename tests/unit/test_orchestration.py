"""The orchestration library without Triton: pipelines driven by the runtime's driver
(``bls_models.drive``) over fake sub-models, errors, deadlines and parameters. How a deadline
and a stage timeout bound a sub-request is tested through the runtime (tests/unit/test_runtime.py)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from bls_models import drive, params, pipelines
from bls_models import spec as S
from bls_models.definition import Setup
from bls_models.errors import (
    Code,
    DeadlineExceeded,
    InvalidInput,
    Kind,
    PipelineError,
    classify_sub_error,
    sub_request_failed,
)
from bls_models.group import Job
from bls_models.spec import registered


class FakeSubModels:
    """Answers each stage after a delay (a ``drive`` sender), recording when calls start and
    end."""

    def __init__(self, delays: dict[str, float], fail: dict[str, PipelineError] | None = None):
        self.delays = delays
        self.fail = fail or {}
        self.log: list[tuple[str, str, float]] = []

    def __call__(self, sub):
        stage, inputs, outputs, reduce = sub.stage, sub.inputs, sub.outputs, sub.reduce
        self.log.append(("start", stage, time.monotonic()))
        time.sleep(self.delays.get(stage, 0.0))
        self.log.append(("end", stage, time.monotonic()))
        self.requested = list(outputs)
        if stage in self.fail:
            raise self.fail[stage]
        batch = len(next(iter(inputs.values())))
        rng = np.random.default_rng(len(self.log))
        shapes = {"PIXELS": (3, 224, 224), "LOGITS": (1000,), "EMBEDDING": (256,),
                  "TAGS": (S.TAGGER_SEQ_LEN,), "TAG_PROBS": (S.TAGGER_SEQ_LEN,)}
        if stage == "tagger":
            shapes["LOGITS"] = (S.TAGGER_SEQ_LEN, 16)
        result = {name: rng.standard_normal((batch, *shapes[name])).astype(np.float32)
                  for name in outputs}
        if "TAGS" in result:
            result["TAGS"] = rng.integers(0, S.TAGGER_VOCAB, (batch, S.TAGGER_SEQ_LEN))
        return reduce(result) if reduce else result


def run(pipeline, inputs, fake, setup=Setup()):
    """``pipeline`` over ``fake``, gathered branches on a pool of 4 threads (as the runtime
    drives it)."""
    pool = drive.Pool(4, "test", lambda message, error=False: None)
    try:
        return drive.drive(pipeline(inputs, drive.Call, setup), fake, pool)
    finally:
        pool.shutdown(1.0)


def image_inputs(batch=2):
    return {"IMAGE": np.zeros((batch, 224, 224, 3), np.uint8)}


def test_branches_run_concurrently():
    fake = FakeSubModels({"preprocess": 0.01, "classifier": 0.2, "embedder": 0.2})
    started = time.monotonic()
    out = run(pipelines.image_pipeline, image_inputs(), fake)
    elapsed = time.monotonic() - started
    starts = {stage: t for kind, stage, t in fake.log if kind == "start"}
    ends = {stage: t for kind, stage, t in fake.log if kind == "end"}
    assert starts["classifier"] >= ends["preprocess"] and starts["embedder"] >= ends["preprocess"]
    assert starts["embedder"] < ends["classifier"] and starts["classifier"] < ends["embedder"]
    assert elapsed < 0.39  # max(a, b) + preprocess, not a + b
    assert out["CLASS_IDS"].shape == (2, 5) and out["CLASS_IDS"].dtype == np.int64
    assert out["CLASS_PROBS"].dtype == np.float32 and out["EMBEDDING"].shape == (2, 256)


def test_a_failing_branch_waits_for_its_sibling_then_raises():
    failure = sub_request_failed("classifier", "classifier", "boom")
    fake = FakeSubModels({"embedder": 0.1}, fail={"classifier": failure})
    with pytest.raises(PipelineError) as raised:
        run(pipelines.image_pipeline, image_inputs(), fake)
    assert raised.value is failure
    assert ("end", "embedder") in [(k, s) for k, s, _ in fake.log], "sibling left running"


def test_a_failed_preprocess_issues_no_further_stage():
    fake = FakeSubModels({}, fail={"preprocess": sub_request_failed("preprocess", "p", "x")})
    with pytest.raises(PipelineError):
        run(pipelines.image_pipeline, image_inputs(), fake)
    assert {s for _, s, _ in fake.log} == {"preprocess"}


def test_softmax_top_k_matches_a_direct_computation():
    logits = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    ids, probs = pipelines.softmax_top_k(logits)
    full = np.exp(logits - logits.max(1, keepdims=True))
    full /= full.sum(1, keepdims=True)
    for row in range(3):
        expected = np.argsort(full[row])[::-1][:5]
        assert list(ids[row]) == list(expected)
        np.testing.assert_allclose(probs[row], full[row][expected], rtol=1e-6)
    assert np.all(np.diff(probs, axis=1) <= 0)


def test_top_k_ties_go_to_the_lower_class_id():
    ids, _ = pipelines.softmax_top_k(np.zeros((1, 10), np.float32), k=3)
    assert list(ids[0]) == [0, 1, 2]


@pytest.mark.parametrize("reduced_by_model, requested", [(True, ["TAGS", "TAG_PROBS"]),
                                                         (False, ["LOGITS"])])
def test_tag_pipeline_asks_the_tagger_for_what_it_reduces_or_reduces_logits_itself(
        reduced_by_model, requested):
    fake = FakeSubModels({})
    tokens = np.ones((2, S.TAGGER_SEQ_LEN), np.int64)
    setup = Setup(contracts={"tagger": S.TAGGER_TAGS if reduced_by_model else S.TAGGER})
    out = run(pipelines.tag_pipeline, {"TOKENS": tokens}, fake, setup)
    assert fake.requested == requested
    assert set(out) == {"TAGS", "TAG_PROBS"}
    assert out["TAGS"].shape == (2, S.TAGGER_SEQ_LEN) and out["TAGS"].dtype == np.int64


class LocalTagger:
    """A stand-in tagger whose answer for a token depends on it and its neighbours (a receptive
    field of 3, like the committed tagger's convolution), recording each sub-request's rows."""

    def __init__(self):
        self.rows: list[int] = []

    @staticmethod
    def tag(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        padded = np.pad(tokens, ((0, 0), (1, 1)))
        mixed = padded[:, :-2] * 3 + padded[:, 1:-1] * 5 + padded[:, 2:] * 7
        return mixed % 101, (mixed % 13 / 13).astype(np.float32)

    def __call__(self, sub):
        tokens = sub.inputs["TOKENS"]
        assert tokens.shape[1:] == (S.TAGGER_SEQ_LEN,)
        self.rows.append(len(tokens))
        tags, probs = self.tag(tokens)
        return {"TAGS": tags, "TAG_PROBS": probs}


def windowed_reference(tokens: np.ndarray, overlap: int) -> tuple[np.ndarray, np.ndarray]:
    """What each token's tag must be: from the window whose centre is nearest (the earlier one
    on a tie), computed token by token."""
    length = tokens.shape[1]
    window = S.TAGGER_SEQ_LEN
    if length <= window:
        padded = np.zeros((len(tokens), window), np.int64)
        padded[:, :length] = tokens
        tags, probs = LocalTagger.tag(padded)
        return tags[:, :length], probs[:, :length]
    starts, _ = pipelines.windows(length, window, overlap)
    tags = np.empty(tokens.shape, np.int64)
    probs = np.empty(tokens.shape, np.float32)
    for token in range(length):
        best = max(starts, key=lambda s: (min(token - s, s + window - 1 - token)
                                          if s <= token < s + window else -1, -s))
        t, p = LocalTagger.tag(tokens[:, best:best + window])
        tags[:, token], probs[:, token] = t[:, token - best], p[:, token - best]
    return tags, probs


@pytest.mark.parametrize("length", [1, 511, 512, 513, 1000, 2048])
@pytest.mark.parametrize("overlap", [0, 64, 256])
def test_tag_pipeline_windows_a_document_and_stitches_each_token_from_its_best_window(
        length, overlap):
    tokens = np.random.default_rng(length).integers(0, S.TAGGER_VOCAB, (3, length))
    tagger = LocalTagger()
    setup = Setup(options={"window_overlap": overlap}, contracts={"tagger": S.TAGGER_TAGS},
                  max_rows={"tagger": 4})
    out = drive.drive(pipelines.tag_pipeline({"TOKENS": tokens}, drive.Call, setup), tagger)
    tags, probs = windowed_reference(tokens, overlap)
    np.testing.assert_array_equal(out["TAGS"], tags)
    np.testing.assert_array_equal(out["TAG_PROBS"], probs)
    windows = len(pipelines.windows(length, S.TAGGER_SEQ_LEN, overlap)[0])
    # Every window of the three documents, in sub-requests of at most the tagger's 4 rows.
    assert sum(tagger.rows) == 3 * windows and max(tagger.rows) <= 4
    assert len(tagger.rows) == -(-3 * windows // 4)


def test_a_document_of_one_window_is_sent_as_it_is():
    tokens = np.random.default_rng(0).integers(0, S.TAGGER_VOCAB, (2, S.TAGGER_SEQ_LEN))
    sent = []
    def tagger(sub):
        sent.append(sub.inputs["TOKENS"])
        return LocalTagger()(sub)
    out = drive.drive(pipelines.tag_pipeline({"TOKENS": tokens}, drive.Call, Setup()), tagger)
    assert len(sent) == 1 and np.shares_memory(sent[0], tokens)
    np.testing.assert_array_equal(sent[0], tokens)
    np.testing.assert_array_equal(out["TAGS"], LocalTagger.tag(tokens)[0])


@pytest.mark.parametrize("overlap", [0, 64, 256])
def test_windows_share_the_overlap_and_cover_the_document(overlap):
    for length in range(513, 4000, 37):
        starts, ends = pipelines.windows(length, S.TAGGER_SEQ_LEN, overlap)
        assert starts[0] == 0 and starts[-1] + S.TAGGER_SEQ_LEN == length
        assert all(S.TAGGER_SEQ_LEN - (b - a) >= overlap for a, b in zip(starts, starts[1:]))
        assert ends[-1] == length and ends == sorted(ends)
        # Fewest windows: one fewer could not keep the overlap.
        assert len(starts) == 1 + -(-(length - S.TAGGER_SEQ_LEN) // (S.TAGGER_SEQ_LEN - overlap))


@pytest.mark.parametrize("tokens, words", [(np.zeros((1, 0), np.int64), "empty"),
                                           (np.zeros((1, 8193), np.int64), "8192")])
def test_empty_and_too_long_documents_fail_tag_pipelines_check(tokens, words):
    setup = Setup(options=S.TAG_PIPELINE_DEF.parse({}).options)
    with pytest.raises(InvalidInput) as raised:
        S.TAG_PIPELINE_DEF.check_function()({"TOKENS": tokens}, setup)
    assert raised.value.code is Code.INVALID_ARG and words in raised.value.message
    S.TAG_PIPELINE_DEF.check_function()({"TOKENS": np.zeros((1, 8192), np.int64)}, setup)


def test_reduce_tags_gives_argmax_and_its_probability():
    logits = np.random.default_rng(1).standard_normal((2, 4, 50)).astype(np.float32) * 5
    tags, probs = pipelines.reduce_tags(logits)
    np.testing.assert_array_equal(tags, logits.argmax(-1))
    soft = np.exp(logits - logits.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, soft.max(-1), rtol=1e-5)
    assert tags.dtype == np.int64 and probs.dtype == np.float32


@pytest.mark.parametrize("bad", [-1, S.TAGGER_VOCAB, 10**9])
def test_out_of_range_tokens_fail_tag_pipelines_check(bad):
    tokens = np.zeros((1, S.TAGGER_SEQ_LEN), np.int64)
    tokens[0, 3] = bad
    check = S.TAG_PIPELINE_DEF.check_function()
    with pytest.raises(InvalidInput) as raised:
        check({"TOKENS": tokens})
    assert raised.value.code is Code.INVALID_ARG and str(bad) in raised.value.message
    check({"TOKENS": np.full((1, S.TAGGER_SEQ_LEN), S.TAGGER_VOCAB - 1, np.int64)})


# The real messages of r24.10's core, python, onnxruntime and tensorrt backends (sources in
# bls_models/errors.py and docs/orchestrator.md, "Errors"): a case per rule, and the device
# faults whose words ("invalid argument", "out of bounds") once read as the client's.
PREFIX = "Model classifier - Error when running inference: "  # request_executor.cc 447-455
CLASSIFIED = [
    ("Request timeout expired", Kind.DEADLINE, Code.UNAVAILABLE),
    (PREFIX + "[request id: r1] Exceeds maximum queue size", Kind.QUEUE_FULL, Code.UNAVAILABLE),
    (PREFIX + "Server is stopping, scheduler for model has stopped accepting new inference "
     "requests", Kind.NOT_READY, Code.UNAVAILABLE),
    ("Request for unknown model: 'classifier' has no available versions", Kind.NOT_READY,
     Code.UNAVAILABLE),
    (PREFIX + "Failed for execute the inference request. Model 'x' is not ready.",
     Kind.NOT_READY, Code.UNAVAILABLE),
    ("Failed to increase the shared memory pool size for key 'k' to 2097152 bytes. If you are "
     "running Triton inside docker, use '--shm-size' flag", Kind.SHM, Code.UNAVAILABLE),
    ("onnx runtime error 6: Non-zero status code returned while running Conv node. Name:'c' "
     "Status Message: Failed to allocate memory for requested buffer of size 12845056",
     Kind.MEMORY, Code.UNAVAILABLE),
    ("onnx runtime error 1: CUDA failure 2: out of memory ; GPU=0", Kind.MEMORY,
     Code.UNAVAILABLE),
    # ONNX Runtime's CUDA faults, under codes 1 and 6 (onnxruntime#23149, server#7296), and one
    # as a code 2 would read: a device's fault whatever the code.
    ("onnx runtime error 1: Non-zero status code returned while running Transpose node. "
     "Name:'t' Status Message: CUDA error cudaErrorInvalidValue:invalid argument", Kind.FAILED,
     Code.INTERNAL),
    ("onnx runtime error 6: /onnxruntime/core/providers/cuda/cuda_call.cc:121 CUBLAS failure "
     "1: invalid argument ; GPU=0 ; expr=cublasSetStream", Kind.FAILED, Code.INTERNAL),
    ("onnx runtime error 2: CUDA error cudaErrorInvalidValue:invalid argument", Kind.FAILED,
     Code.INTERNAL),
    ("onnx runtime error 1: CUDA failure 700: an illegal memory access was encountered",
     Kind.FAILED, Code.INTERNAL),
    ("unable to enqueue for inference classifier_trt_0_0", Kind.FAILED, Code.INTERNAL),
    ("unable to execute graph for inference classifier_trt_0_0: invalid argument", Kind.FAILED,
     Code.INTERNAL),
    ("input 'PIXELS': failed to perform CUDA copy: invalid argument", Kind.FAILED,
     Code.INTERNAL),
    (PREFIX + "[request id: <id_unknown>] unexpected shape for input 'PIXELS' for model "
     "'classifier'. Expected [-1,3,224,224], got [1,3,100,100].", Kind.INVALID, Code.INVALID_ARG),
    ("[request id: <id_unknown>] inference input 'PIXELS' data-type is 'FP64', but model "
     "'classifier' expects 'FP32'", Kind.INVALID, Code.INVALID_ARG),
    ("expected 1 inputs but got 0 inputs for model 'classifier'. Got input(s) [], but missing "
     "required input(s) ['PIXELS'].", Kind.INVALID, Code.INVALID_ARG),
    ("[request id: r] inference request batch-size must be <= 16 for 'classifier'", Kind.INVALID,
     Code.INVALID_ARG),
    ("input byte size mismatch for input 'PIXELS' for model 'classifier'. Expected 602112, got "
     "8", Kind.INVALID, Code.INVALID_ARG),
    ("unexpected inference input 'PIXEL' for model 'classifier'", Kind.INVALID,
     Code.INVALID_ARG),
    ("onnx runtime error 2: Non-zero status code returned while running Gather node. Name:'' "
     "Status Message: indices element out of data bounds, idx=7 must be within the inclusive "
     "range [-2,1]", Kind.INVALID, Code.INVALID_ARG),
    ("onnx runtime error 2: Got invalid dimensions for input: PIXELS for the following indices",
     Kind.INVALID, Code.INVALID_ARG),
    ("onnx runtime error 6: Non-zero status code returned while running Conv node.",
     Kind.FAILED, Code.INTERNAL),
    ("onnx runtime error 11: TensorRT EP execution context enqueue failed.", Kind.FAILED,
     Code.INTERNAL),
    ("request specifies invalid shape for input 'PIXELS' for classifier_trt_0_0. Error details: "
     "model expected the shape of dimension 0 to be between 1 and 16 but received 17",
     Kind.INVALID, Code.INVALID_ARG),
    ("Stub process 'classifier_0_0' is not healthy.", Kind.FAILED, Code.INTERNAL),
    ("division by zero: index out of bounds, invalid argument", Kind.FAILED, Code.INTERNAL),
]


@pytest.mark.parametrize("message, kind, code", CLASSIFIED)
def test_sub_model_errors_are_classified_by_message(message, kind, code):
    assert classify_sub_error(message) is kind
    error = sub_request_failed("classifier", "classifier_v2", message + "\nTraceback: ...")
    assert error.code is code and error.kind is kind
    assert "classifier" in error.message and "classifier_v2" in error.message
    assert "Traceback" not in error.message
    if kind is Kind.DEADLINE:
        assert "deadline" in error.message


def test_deadline_from_client_timeout_or_default():
    """A request's deadline counts from its arrival in execute: its client timeout, else the
    default deadline."""
    client = Job(None, "r", 100.0, timeout_us=250_000, default_ms=5000, max_ms=120_000)
    assert client.limit == "client timeout" and client.end == pytest.approx(100.25)
    assert client.budget_ms == pytest.approx(250)
    default = Job(None, "r", 100.0, timeout_us=0, default_ms=5000, max_ms=120_000)
    assert default.limit == "default deadline" and default.end == pytest.approx(105.0)


def test_a_client_timeout_above_the_maximum_is_cut_to_it():
    """What lets the supervisor know when a replaced copy's stub can hold nothing any more."""
    long = Job(None, "r", 100.0, timeout_us=300_000_000, default_ms=5000, max_ms=120_000)
    assert long.end == pytest.approx(220.0) and "max_deadline_ms" in long.limit
    within = Job(None, "r", 100.0, timeout_us=119_000_000, default_ms=5000, max_ms=120_000)
    assert within.limit == "client timeout" and within.end == pytest.approx(219.0)


def test_a_default_deadline_above_the_maximum_fails_the_load():
    with pytest.raises(params.ConfigError, match="default_deadline_ms .* above max_deadline_ms"):
        S.PIPELINE_DEF.parse({"default_deadline_ms": "60000", "max_deadline_ms": "30000"})
    assert S.PIPELINE_DEF.parse({}).max_deadline_ms == int(params.MAX_DEADLINE.default)


def test_deadline_error_names_stage_model_and_is_unavailable():
    error = DeadlineExceeded("embedder", "embedder", 250, "client timeout")
    assert error.code is Code.UNAVAILABLE
    assert "deadline" in error.message and "'embedder'" in error.message and "250 ms" in error.message


IMAGE = S.PIPELINE_DEF


def test_parameters_default_and_override():
    config = IMAGE.parse({"classifier_model": "classifier_trt", "classifier_timeout_ms": "150",
                          "default_deadline_ms": "2000"})
    assert config.stage("classifier").model == "classifier_trt"
    assert config.stage("classifier").timeout_ms == 150
    assert config.stage("preprocess") == params.Stage("preprocess", "preprocess", 0)
    assert config.default_deadline_ms == 2000
    assert config.options == {}


def test_bad_parameters_are_all_reported():
    with pytest.raises(params.ConfigError) as raised:
        IMAGE.parse({"classifer_model": "x", "classifier_timeout_ms": "soon",
                     "default_deadline_ms": "0", "gpu_tensors": "yes", "coalesce": "on"})
    message = str(raised.value)
    for fragment in ("unknown parameter 'classifer_model'", "'classifier_timeout_ms' must be an integer",
                     "'default_deadline_ms' must be >= 1", "'gpu_tensors' must be one of",
                     "unknown parameter 'coalesce'"):
        assert fragment in message


@pytest.mark.parametrize("key", ["max_inflight_requests", "max_queued_requests",
                                 "return_within_ms"])
def test_a_parameter_of_the_replaced_runtime_is_a_load_error(key):
    """Admission slots, their queue and the bounded wait for answers are gone (every request is
    answered within ``execute``): a config still setting them fails to load, naming the key,
    rather than silently doing nothing."""
    with pytest.raises(params.ConfigError, match=f"unknown parameter '{key}'"):
        IMAGE.parse({key: "1"})


@pytest.mark.parametrize("key", ["gpu_tensors", "classifier_model"])
def test_a_parameter_the_pipeline_does_not_use_is_a_load_error(key):
    """tag_pipeline has one stage and no pass-through outputs: these would do nothing there."""
    assert key in {p.name for p in IMAGE.accepted()}
    with pytest.raises(params.ConfigError, match=f"unknown parameter '{key}'"):
        S.TAG_PIPELINE_DEF.parse({key: IMAGE.parse({}).options.get(key, "on")})


def test_each_pipeline_has_its_own_defaults_and_the_common_ones():
    image, tags = IMAGE.parse({}), S.TAG_PIPELINE_DEF.parse({})
    assert (image.subrequest_threads, tags.subrequest_threads) == (16, 8)
    assert image.default_deadline_ms == tags.default_deadline_ms == 10_000
    assert tags.stage("tagger").model == "tagger_tags"


@pytest.mark.parametrize("model", S.BLS_MODELS, ids=lambda m: m.name)
def test_committed_bls_parameters_parse(model):
    from modelgen import configs

    definition = registered(model.orchestrates)
    parsed = definition.parse(params.string_parameters(configs.config_dict(model)))
    assert set(parsed.stages) == set(definition.contracts)


def test_stage_models_are_checked_against_the_repository(repository, tmp_path):
    from bls_models import repository as repo_check

    stages = {"classifier": params.Stage("classifier", "embedder", 0),
              "embedder": params.Stage("embedder", "missing_model", 0)}
    problems = repo_check.stage_problems([tmp_path, repository], stages, IMAGE.contracts)
    assert any("'embedder'" in p and "no tensor 'LOGITS'" in p for p in problems)
    assert any("no model 'missing_model'" in p for p in problems)
    good = {s: params.Stage(s, accepted[0].name, 0) for s, accepted in IMAGE.contracts.items()}
    assert repo_check.stage_problems([tmp_path, repository], good, IMAGE.contracts) == []
    assert "no model 'preprocess'" in " ".join(
        repo_check.stage_problems([tmp_path], good, IMAGE.contracts))


@pytest.mark.parametrize("definition", S.PIPELINE_DEFS, ids=lambda d: d.name)
def test_each_pipeline_asks_each_stage_only_for_tensors_of_its_contract(definition):
    assert pipelines.contract_problems(definition) == []


def test_a_pipeline_that_strays_from_its_contracts_is_caught():
    async def strays(inputs, call, setup):
        pixels = await call("preprocess", {"IMAGE": inputs["IMAGE"]}, ["PIXELS"])
        logits = await call("classifier", {"PIXELS": pixels["PIXELS"]}, ["EMBEDDING"])
        return {"CLASS_IDS": logits.get("EMBEDDING"), "CLASS_PROBS": np.zeros((1, 5), np.float64)}

    problems = pipelines.contract_problems(dataclasses.replace(IMAGE, run=strays))
    assert any("stage 'classifier'" in p and "no output ['EMBEDDING']" in p for p in problems)
    assert any("stage 'embedder' was never called" in p for p in problems)
    assert any("no output 'CLASS_IDS'" in p for p in problems)
    assert any("output 'CLASS_PROBS' is float64" in p for p in problems)
    assert any("no output 'EMBEDDING'" in p for p in problems)
