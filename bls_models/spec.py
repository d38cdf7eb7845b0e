"""The contract of every model in the repository: one source of truth.

Tensor names, dtypes and shapes defined here are used by the ONNX exporter (``modelgen``),
by the ``config.pbtxt`` generator, by the orchestrators and by the tests; the orchestrators
themselves are defined here too, one ``PipelineDef`` each (``bls_models/definition.py``), and
the metrics every orchestrator exports. Nothing here imports Triton, numpy or torch, so the
orchestrators can use it inside the python-backend stub and the unit tests can use it anywhere.

Shapes never include the batch dimension: every model here batches (``max_batch_size > 0``)
and Triton prepends the batch axis.
"""

from __future__ import annotations

from dataclasses import replace

from bls_models.definition import (
    BatchingSpec,
    EnsembleStep,
    ModelSpec,
    PipelineDef,
    StageDef,
    TensorSpec,
)
from bls_models.errors import Code, Kind
from bls_models.params import Param, RealParam

# ImageNet normalisation applied by `preprocess`.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SIZE = 224

# The tagger's vocabulary and sequence length (the "28 MB output" case: 512 x 14041 x 4 bytes).
TAGGER_VOCAB = 14041
TAGGER_SEQ_LEN = 512

NUM_CLASSES = 1000
EMBEDDING_DIM = 256


# Triton model-config data type -> numpy dtype name: the project's one table (the runtime, the
# exporter's and the tests' checks derive theirs from it; spec stays free of numpy).
DTYPES: dict[str, str] = {
    "TYPE_BOOL": "bool", "TYPE_UINT8": "uint8", "TYPE_INT32": "int32", "TYPE_INT64": "int64",
    "TYPE_FP16": "float16", "TYPE_FP32": "float32", "TYPE_STRING": "object",
}


IMAGE = TensorSpec("IMAGE", "TYPE_UINT8", (IMAGE_SIZE, IMAGE_SIZE, 3))
PIXELS = TensorSpec("PIXELS", "TYPE_FP32", (3, IMAGE_SIZE, IMAGE_SIZE))
CLASS_LOGITS = TensorSpec("LOGITS", "TYPE_FP32", (NUM_CLASSES,))
EMBEDDING = TensorSpec("EMBEDDING", "TYPE_FP32", (EMBEDDING_DIM,))
TOKENS = TensorSpec("TOKENS", "TYPE_INT64", (TAGGER_SEQ_LEN,))
TAG_LOGITS = TensorSpec("LOGITS", "TYPE_FP32", (TAGGER_SEQ_LEN, TAGGER_VOCAB))
TAGS = TensorSpec("TAGS", "TYPE_INT64", (TAGGER_SEQ_LEN,))
TAG_PROBS = TensorSpec("TAG_PROBS", "TYPE_FP32", (TAGGER_SEQ_LEN,))
# tag_pipeline's documents: any length from 1 to its `max_tokens`, cut into the tagger's windows.
DOCUMENT = TensorSpec(TOKENS.name, TOKENS.dtype, (-1,))
DOCUMENT_TAGS = TensorSpec(TAGS.name, TAGS.dtype, (-1,))
DOCUMENT_TAG_PROBS = TensorSpec(TAG_PROBS.name, TAG_PROBS.dtype, (-1,))
MAX_TOKENS = 8192
WINDOW_OVERLAP = 64

# Instance counts and batching delays of preprocess, classifier, embedder and digits_large are
# Triton Model Analyzer's choice (`make tune`, bench/results/tuning/SUMMARY.md: the highest
# throughput at concurrency 16 within a 250 ms p99, 2-core CPU host, 2026-11-27);
# tests/tooling/test_tuned_values.py keeps them equal to bench/results/tuning/summary.json.
# Max batch sizes and preferred batch sizes were not searched (docs/benchmarks.md, "Tuning").
_LARGE_BATCHES = BatchingSpec(preferred_batch_sizes=(8, 16), max_queue_delay_us=100)
_SMALL_BATCHES = BatchingSpec(preferred_batch_sizes=(4, 8), max_queue_delay_us=100)

# Parameters of Triton's onnxruntime backend for CPU instances (docs/configuration.md; measured
# by `make bench-ort_options`). One intra-op and one inter-op thread per ONNX Runtime session:
# without them each session sizes its own pool to the machine's cores, and the 10 instances of
# the CNN pipeline then oversubscribe the cores with spinning threads. Concurrency comes from
# instances and batches instead. The GPU profiles set their own (modelgen/profiles.py).
ORT_CPU_PARAMETERS = {"intra_op_thread_count": "1", "inter_op_thread_count": "1"}


def onnx_model(name: str, inputs: tuple, outputs: tuple, description: str,
               batching: BatchingSpec = _LARGE_BATCHES, max_batch_size: int = 16,
               **instances: int) -> ModelSpec:
    """A model served by Triton's onnxruntime backend, with the CPU parameters."""
    return ModelSpec(name=name, backend="onnxruntime", parameters=ORT_CPU_PARAMETERS,
                     inputs=inputs, outputs=outputs, max_batch_size=max_batch_size,
                     batching=batching, description=description, **instances)


PREPROCESS = onnx_model("preprocess", (IMAGE,), (PIXELS,),
                        "UINT8 HWC image -> ImageNet-normalised FP32 CHW pixels")
# Tuned: 4 instances (one ONNX Runtime thread each, ORT_CPU_PARAMETERS).
CLASSIFIER = onnx_model("classifier", (PIXELS,), (CLASS_LOGITS,),
                        "ResNet-style CNN, 1000 class logits", instance_count=4)
# Tuned (make tune): 2 instances, 4 % more than 4 at concurrency 16 in the same run.
EMBEDDER = onnx_model("embedder", (PIXELS,), (EMBEDDING,),
                      "Depthwise-separable CNN, L2-normalised 256-d embedding",
                      batching=_SMALL_BATCHES, instance_count=2)
# One item's output is 28.7 MB: keep batches small so a batch stays well inside shm.
TAGGER = onnx_model("tagger", (TOKENS,), (TAG_LOGITS,),
                    "Token tagger with a 512 x 14041 logits output (the large-output case)",
                    batching=BatchingSpec(preferred_batch_sizes=(2, 4), max_queue_delay_us=500),
                    max_batch_size=4)
# The same network (same weights) exported with its reduction in the graph: per-token argmax
# and that token's softmax probability, 8 bytes per token instead of 56 KB. The 28.7 MB of
# logits exist only inside ONNX Runtime (or TensorRT, on the GPU) and are never copied out.
TAGGER_TAGS = replace(
    TAGGER,
    name="tagger_tags",
    outputs=(TAGS, TAG_PROBS),
    description="The tagger with its reduction in the ONNX graph: TAGS and TAG_PROBS per token",
)

TOP_K = 5
CLASS_IDS = TensorSpec("CLASS_IDS", "TYPE_INT64", (TOP_K,))
CLASS_PROBS = TensorSpec("CLASS_PROBS", "TYPE_FP32", (TOP_K,))

# Not tuned (only the ensemble baseline uses it): the same batching as its producer, the
# classifier.
POSTPROCESS = onnx_model("postprocess", (CLASS_LOGITS,), (CLASS_IDS, CLASS_PROBS),
                         "softmax + top-5 over class logits (the ensemble's last step)")

# The digits cascade (modelgen/digits.py trains both on scikit-learn's bundled 8x8 digits): raw
# pixels 0..16 in, softmax probabilities out, the scaling and the softmax in each graph.
DIGIT_PIXELS = TensorSpec("DIGIT_PIXELS", "TYPE_FP32", (64,))
DIGIT_PROBS = TensorSpec("DIGIT_PROBS", "TYPE_FP32", (10,))
# A batch of 32 rows and a 100 us delay let the batcher merge concurrent requests without
# holding a lone one back.
_DIGITS_BATCHES = BatchingSpec(preferred_batch_sizes=(16, 32), max_queue_delay_us=100)
DIGITS_SMALL = onnx_model(
    "digits_small", (DIGIT_PIXELS,), (DIGIT_PROBS,),
    "8x8 digit -> class probabilities through one linear layer (the cheap opinion)",
    batching=_DIGITS_BATCHES, max_batch_size=32)
DIGITS_LARGE = replace(
    DIGITS_SMALL,
    name="digits_large",
    # It stands for a real large model: a CNN over the image scaled up to 48x48, several ms of
    # one CPU thread per row (docs/cascade.md). Tuned (make tune): 4 instances of one thread
    # and a 500 us batching delay.
    batching=BatchingSpec(preferred_batch_sizes=(16, 32), max_queue_delay_us=500),
    instance_count=4,
    description="8x8 digit scaled to 48x48 -> class probabilities through a 6-layer CNN (the "
                "costly, better one)",
)

ONNX_MODELS: tuple[ModelSpec, ...] = (PREPROCESS, CLASSIFIER, EMBEDDER, TAGGER, TAGGER_TAGS,
                                       POSTPROCESS, DIGITS_SMALL, DIGITS_LARGE)

def reduces_tags(contract: ModelSpec) -> bool:
    """Whether a tagger-stage model answers with TAGS and TAG_PROBS itself."""
    return {TAGS, TAG_PROBS} <= set(contract.outputs)


# The BLS orchestrators: one definition each (bls_models/definition.py). Their ModelSpecs, config
# parameters and defaults, stage checks and metric series all derive from these.
PIPELINE_DEF = PipelineDef(
    name="pipeline",
    inputs=(IMAGE,),
    outputs=(CLASS_IDS, CLASS_PROBS, EMBEDDING),
    # PIXELS only flows into the classifier and the embedder: with gpu_tensors on, it stays on
    # the GPU.
    stages=(StageDef("preprocess", (PREPROCESS,), pass_through=(PIXELS.name,)),
            StageDef("classifier", (CLASSIFIER,)),
            StageDef("embedder", (EMBEDDER,))),
    run="bls_models.pipelines:image_pipeline",
    max_batch_size=16,
    description="BLS: preprocess, then classifier and embedder concurrently; top-5 + embedding",
)
TAG_PIPELINE_DEF = PipelineDef(
    name="tag_pipeline",
    inputs=(DOCUMENT,),
    outputs=(DOCUMENT_TAGS, DOCUMENT_TAG_PROBS),
    # The tagger with its reduction in the graph by default; a model with the tagger's LOGITS
    # output also works (the orchestrator then reduces the 28.7 MB of logits per sequence itself,
    # measured slower). The load-time check decides which contract the configured model meets.
    stages=(StageDef("tagger", (TAGGER_TAGS, TAGGER)),),
    run="bls_models.pipelines:tag_pipeline",
    # Token ids and lengths are checked per request, before its rows are stacked with others'.
    check="bls_models.pipelines:check_tokens",
    parameters=(
        Param("max_tokens", str(MAX_TOKENS), "the longest document accepted, in tokens; longer "
              "ones are refused INVALID_ARG", minimum=1),
        Param("window_overlap", str(WINDOW_OVERLAP),
              f"tokens consecutive {TAGGER_SEQ_LEN}-token windows of a longer document share; "
              "each token is tagged from the window where it has the most context on both sides",
              minimum=0, maximum=TAGGER_SEQ_LEN // 2),
    ),
    max_batch_size=4,
    # With a LOGITS tagger as the stage model, each response holding 28.7 MB per sequence sits in
    # this stub's shared memory until reduced: the thread count bounds that (8 x 4 x 28.7 MB).
    defaults={"subrequest_threads": "8"},
    description="BLS: documents of any length cut into overlapping windows for the tagger, "
                "reduced on the server to per-token argmax and its probability",
)
DIGIT = TensorSpec("DIGIT", "TYPE_INT64", (1,))
DIGIT_PROB = TensorSpec("DIGIT_PROB", "TYPE_FP32", (1,))
ESCALATED = TensorSpec("ESCALATED", "TYPE_BOOL", (1,))
# Chosen on the validation split by `python -m modelgen.digits` (docs/cascade.md): the lowest
# threshold whose cascade is within 0.3 points of digits_large alone there.
CASCADE_THRESHOLD = RealParam(
    "threshold", "0.55",
    "a row whose top probability from `small` is at least this is answered "
    "from it, the others from `large` (0: never escalate; above 1: always)", minimum=0)
DIGITS_CASCADE_DEF = PipelineDef(
    name="digits_cascade",
    inputs=(DIGIT_PIXELS,),
    outputs=(DIGIT, DIGIT_PROB, ESCALATED),
    stages=(StageDef("small", (DIGITS_SMALL,)), StageDef("large", (DIGITS_LARGE,))),
    run="bls_models.cascade:digits_cascade",
    parameters=(CASCADE_THRESHOLD,),
    # As many rows as its stage models take, so the unsure rows of a run go to `large` as one
    # sub-request.
    max_batch_size=DIGITS_LARGE.max_batch_size,
    description="BLS: digits_small for every row, digits_large only for the rows it is unsure of",
)
PIPELINE_DEFS: tuple[PipelineDef, ...] = (PIPELINE_DEF, TAG_PIPELINE_DEF, DIGITS_CASCADE_DEF)


def registered(name: str) -> PipelineDef:
    """The repository's own pipeline ``name``: what a generated model.py names."""
    for definition in PIPELINE_DEFS:
        if definition.name == name:
            return definition
    raise KeyError(f"no pipeline named '{name}' (the repository's own: "
                   f"{', '.join(d.name for d in PIPELINE_DEFS)})")


PIPELINE = PIPELINE_DEF.model_spec()
TAG_PIPELINE = TAG_PIPELINE_DEF.model_spec()
PIPELINE_ENSEMBLE = ModelSpec(
    name="pipeline_ensemble",
    backend="",
    platform="ensemble",
    inputs=(IMAGE,),
    outputs=(CLASS_IDS, CLASS_PROBS, EMBEDDING),
    max_batch_size=16,
    batching=None,
    instance_count=0,
    # Between steps, PIXELS and LOGITS travel as the ensemble's internal tensors "pixels" and
    # "logits"; the rest keep their names.
    ensemble_steps=(
        EnsembleStep(PREPROCESS.name, {IMAGE.name: IMAGE.name}, {PIXELS.name: "pixels"}),
        EnsembleStep(CLASSIFIER.name, {PIXELS.name: "pixels"}, {CLASS_LOGITS.name: "logits"}),
        EnsembleStep(EMBEDDER.name, {PIXELS.name: "pixels"}, {EMBEDDING.name: EMBEDDING.name}),
        EnsembleStep(POSTPROCESS.name, {CLASS_LOGITS.name: "logits"},
                     {CLASS_IDS.name: CLASS_IDS.name, CLASS_PROBS.name: CLASS_PROBS.name}),
    ),
    description="Ensemble computing what `pipeline` computes (the benchmark's baseline)",
)

DIGITS_CASCADE = DIGITS_CASCADE_DEF.model_spec()
SMALL_PROBS = TensorSpec("SMALL_PROBS", DIGIT_PROBS.dtype, DIGIT_PROBS.dims)
LARGE_PROBS = TensorSpec("LARGE_PROBS", DIGIT_PROBS.dtype, DIGIT_PROBS.dims)
# The cascade's baseline: an ensemble cannot branch on data, so it runs both models on every row
# and leaves the choice to the client.
DIGITS_ENSEMBLE = ModelSpec(
    name="digits_ensemble",
    backend="",
    platform="ensemble",
    inputs=(DIGIT_PIXELS,),
    outputs=(SMALL_PROBS, LARGE_PROBS),
    max_batch_size=DIGITS_CASCADE_DEF.max_batch_size,
    batching=None,
    instance_count=0,
    ensemble_steps=(
        EnsembleStep(DIGITS_SMALL.name, {DIGIT_PIXELS.name: DIGIT_PIXELS.name},
                     {DIGIT_PROBS.name: SMALL_PROBS.name}),
        EnsembleStep(DIGITS_LARGE.name, {DIGIT_PIXELS.name: DIGIT_PIXELS.name},
                     {DIGIT_PROBS.name: LARGE_PROBS.name}),
    ),
    description="Ensemble running digits_small and digits_large on every row (the cascade's "
                "baseline)",
)

BLS_MODELS: tuple[ModelSpec, ...] = (PIPELINE, TAG_PIPELINE, DIGITS_CASCADE)
ALL_MODELS: tuple[ModelSpec, ...] = (*ONNX_MODELS, *BLS_MODELS, PIPELINE_ENSEMBLE, DIGITS_ENSEMBLE)


def model(name: str) -> ModelSpec:
    for spec in ALL_MODELS:
        if spec.name == name:
            return spec
    raise KeyError(f"no model named '{name}' in the repository spec")


# -- what every orchestrator exports (bls_models/metrics.py publishes them; the dashboard and the
# autoscaler read them) -----------------------------------------------------------------------
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)

# name -> (kind, description)
FAMILIES: dict[str, tuple[str, str]] = {
    "bls_request_latency_seconds": (
        "HISTOGRAM", "Time from receiving a request to sending its response, per orchestrator"),
    "bls_stage_latency_seconds": (
        "HISTOGRAM", "Time a stage's sub-request took (until answered or given up), per stage"),
    "bls_requests_total": (
        "COUNTER", "Requests answered, by status code (SUCCESS or the Triton error code)"),
    "bls_subrequest_errors_total": (
        "COUNTER", "Failed sub-requests, by stage and kind (deadline, queue_full, failed, ...)"),
    "bls_deadline_exceeded_total": (
        "COUNTER", "Requests whose deadline or stage timeout passed, by the stage they waited on"),
    "bls_abandoned_subrequests_total": (
        "COUNTER", "Sub-requests given up on after their deadline while still running"),
    "bls_abandoned_subrequests_completed_total": (
        "COUNTER", "Abandoned sub-requests that have since finished (their result is dropped)"),
    "bls_cancelled_requests_total": (
        "COUNTER", "Requests cancelled by the client, by the stage they were stopped before"),
    "bls_inflight_requests": ("GAUGE", "Requests being orchestrated right now"),
    "bls_owed_answers": (
        "GAUGE", "Requests answered after their execute returned, still unanswered: what a "
        "stub killed now would strand (at most max_owed_answers per instance)"),
    "bls_subrequest_rows": (
        "HISTOGRAM", "Rows per sub-request sent to a stage (a group's stacked requests)"),
    "bls_isolated_requests_total": (
        "COUNTER", "Requests searched for the cause of their group's failure"),
    "bls_isolation_reused_subrequests_total": (
        "COUNTER", "Sub-requests an isolation attempt took from its group's answer"),
    "bls_inflight_subrequests": (
        "GAUGE", "Sub-requests sent and not yet answered, abandoned ones included"),
}
# The codes a request can be answered with: SUCCESS, an error code, or not sent at all.
REQUEST_CODES = ("SUCCESS", *(code.value for code in Code), "SEND_FAILED")


def known_series(stages) -> list[tuple[str, dict[str, str]]]:
    """Every (family, labels) an orchestrator with these stages can produce: created at load,
    at 0, as Prometheus expects of a known label set."""
    per_stage = ("bls_stage_latency_seconds", "bls_subrequest_rows", "bls_deadline_exceeded_total",
                 "bls_abandoned_subrequests_total", "bls_abandoned_subrequests_completed_total",
                 "bls_cancelled_requests_total", "bls_isolation_reused_subrequests_total")
    series = [(family, {}) for family in ("bls_request_latency_seconds", "bls_inflight_requests",
                                          "bls_inflight_subrequests", "bls_owed_answers",
                                          "bls_isolated_requests_total")]
    series += [("bls_requests_total", {"code": code}) for code in REQUEST_CODES]
    for stage in stages:
        series += [(family, {"stage": stage}) for family in per_stage]
        series += [("bls_subrequest_errors_total", {"stage": stage, "kind": kind.value})
                   for kind in Kind]
    return series
