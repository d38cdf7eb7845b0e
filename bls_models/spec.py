"""The contract of every model in the repository: one source of truth.

Tensor names, dtypes and shapes defined here are used by the ONNX exporter (``modelgen``),
by the ``config.pbtxt`` generator, by the orchestrators and by the tests. Nothing here imports
Triton, numpy or torch, so the orchestrators can use it inside the python-backend stub and the
unit tests can use it anywhere.

Shapes never include the batch dimension: every model here batches (``max_batch_size > 0``)
and Triton prepends the batch axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton model-config dtype, e.g. "TYPE_FP32"
    dims: tuple[int, ...]


@dataclass(frozen=True)
class BatchingSpec:
    """Dynamic batching and queue policy of one model.

    ``queue_timeout_us`` is the queue policy's ``default_timeout_microseconds``: the upper bound a
    request may wait in this model's queue. A per-request timeout (the BLS ``timeout``) can only
    lower it (``allow_timeout_override``), never raise it, so it must be set (0 would disable
    overrides). ``max_queue_size`` bounds the queue: beyond it requests are rejected at once.
    """

    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    queue_timeout_us: int = 10_000_000
    max_queue_size: int = 256


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    input_map: dict[str, str]   # the step model's input name -> ensemble tensor name
    output_map: dict[str, str]  # the step model's output name -> ensemble tensor name


@dataclass(frozen=True)
class ModelSpec:
    name: str
    backend: str  # "onnxruntime", "python", or "" for an ensemble (see `platform`)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    batching: BatchingSpec | None  # None: no dynamic batcher (ensembles)
    # Instances per device (KIND_AUTO: one group of `instance_count` on each GPU in the container,
    # CPU instances locally). At least 2 wherever a queue policy is set: with a single instance
    # the dynamic batcher's policy queue stalled in ~500 ms steps under bursts (measured).
    instance_count: int = 2
    # Only where a kind is required: the BLS orchestrators are KIND_CPU (they compute nothing on
    # a GPU, so their instance count must not multiply with the number of GPUs).
    kind: str | None = None
    platform: str = ""
    decoupled: bool = False  # model_transaction_policy (only the measured alternative uses it)
    parameters: dict[str, str] = field(default_factory=dict)
    ensemble_steps: tuple[EnsembleStep, ...] = ()
    description: str = ""

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name, self.name)

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name, self.name)


def _by_name(tensors: tuple[TensorSpec, ...], name: str, model: str) -> TensorSpec:
    for tensor in tensors:
        if tensor.name == name:
            return tensor
    raise KeyError(f"model '{model}' has no tensor '{name}'")


IMAGE = TensorSpec("IMAGE", "TYPE_UINT8", (IMAGE_SIZE, IMAGE_SIZE, 3))
PIXELS = TensorSpec("PIXELS", "TYPE_FP32", (3, IMAGE_SIZE, IMAGE_SIZE))
CLASS_LOGITS = TensorSpec("LOGITS", "TYPE_FP32", (NUM_CLASSES,))
EMBEDDING = TensorSpec("EMBEDDING", "TYPE_FP32", (EMBEDDING_DIM,))
TOKENS = TensorSpec("TOKENS", "TYPE_INT64", (TAGGER_SEQ_LEN,))
TAG_LOGITS = TensorSpec("LOGITS", "TYPE_FP32", (TAGGER_SEQ_LEN, TAGGER_VOCAB))
TAGS = TensorSpec("TAGS", "TYPE_INT64", (TAGGER_SEQ_LEN,))
TAG_PROBS = TensorSpec("TAG_PROBS", "TYPE_FP32", (TAGGER_SEQ_LEN,))

# Instance counts, batching delays and preferred sizes of preprocess, classifier and embedder
# are the winners of `make bench-tuning` (bench/results/REPORT.md, "Tuning"; measured on the
# 2-core CPU host with Triton's C++ onnxruntime backend, 2026-11-23); `pipeline` had no winner
# within its latency budget and keeps 2 instances. tests/unit/test_tuned_values.py keeps them
# equal to bench/results/tuning.json.
_LARGE_BATCHES = BatchingSpec(preferred_batch_sizes=(8, 16), max_queue_delay_us=100)
_SMALL_BATCHES = BatchingSpec(preferred_batch_sizes=(4, 8), max_queue_delay_us=100)

# Parameters of Triton's onnxruntime backend for CPU instances (docs/configuration.md; measured
# by `make bench-ort_options`). One intra-op and one inter-op thread per ONNX Runtime session:
# without them each session sizes its own pool to the machine's cores, and the 10 instances of
# the CNN pipeline then oversubscribe the cores with spinning threads. Concurrency comes from
# instances and batches instead. The GPU profiles set their own (modelgen/profiles.py).
ORT_CPU_PARAMETERS = {"intra_op_thread_count": "1", "inter_op_thread_count": "1"}

PREPROCESS = ModelSpec(
    name="preprocess",
    backend="onnxruntime",
    parameters=ORT_CPU_PARAMETERS,
    inputs=(IMAGE,),
    outputs=(PIXELS,),
    max_batch_size=16,
    batching=_LARGE_BATCHES,
    description="UINT8 HWC image -> ImageNet-normalised FP32 CHW pixels",
)
CLASSIFIER = ModelSpec(
    name="classifier",
    backend="onnxruntime",
    parameters=ORT_CPU_PARAMETERS,
    inputs=(PIXELS,),
    outputs=(CLASS_LOGITS,),
    max_batch_size=16,
    batching=_LARGE_BATCHES,
    # Tuned: 4 instances (one ONNX Runtime thread each, ORT_CPU_PARAMETERS).
    instance_count=4,
    description="ResNet-style CNN, 1000 class logits",
)
EMBEDDER = ModelSpec(
    name="embedder",
    backend="onnxruntime",
    parameters=ORT_CPU_PARAMETERS,
    inputs=(PIXELS,),
    outputs=(EMBEDDING,),
    max_batch_size=16,
    batching=_SMALL_BATCHES,
    instance_count=4,
    description="Depthwise-separable CNN, L2-normalised 256-d embedding",
)
TAGGER = ModelSpec(
    name="tagger",
    backend="onnxruntime",
    parameters=ORT_CPU_PARAMETERS,
    inputs=(TOKENS,),
    outputs=(TAG_LOGITS,),
    # One item's output is 28.7 MB: keep batches small so a batch stays well inside shm.
    max_batch_size=4,
    batching=BatchingSpec(preferred_batch_sizes=(2, 4), max_queue_delay_us=500, max_queue_size=64),
    description="Token tagger with a 512 x 14041 logits output (the large-output case)",
)
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

POSTPROCESS = ModelSpec(
    name="postprocess",
    backend="onnxruntime",
    parameters=ORT_CPU_PARAMETERS,
    inputs=(CLASS_LOGITS,),
    outputs=(CLASS_IDS, CLASS_PROBS),
    max_batch_size=16,
    # Not tuned (only the ensemble baseline uses it): the same batching as its producer, the
    # classifier.
    batching=_LARGE_BATCHES,
    description="softmax + top-5 over class logits (the ensemble's last step)",
)

ONNX_MODELS: tuple[ModelSpec, ...] = (PREPROCESS, CLASSIFIER, EMBEDDER, TAGGER, TAGGER_TAGS,
                                       POSTPROCESS)

# The BLS orchestrators answer through response senders, so their queue empties as fast as
# requests arrive; the queue policy still applies the client's timeout to time spent queued and
# bounds the queue when the orchestrator applies backpressure (max_inflight_requests).
_BLS_BATCHING = BatchingSpec(preferred_batch_sizes=(), max_queue_delay_us=0,
                             queue_timeout_us=30_000_000, max_queue_size=4096)

PIPELINE = ModelSpec(
    name="pipeline",
    backend="python",
    inputs=(IMAGE,),
    outputs=(CLASS_IDS, CLASS_PROBS, EMBEDDING),
    max_batch_size=16,
    batching=_BLS_BATCHING,
    kind="KIND_CPU",
    parameters={
        "preprocess_model": "preprocess",
        "classifier_model": "classifier",
        "embedder_model": "embedder",
        "preprocess_timeout_ms": "0",
        "classifier_timeout_ms": "0",
        "embedder_timeout_ms": "0",
        "default_deadline_ms": "10000",
        "max_inflight_requests": "512",
        "subrequest_threads": "64",
    },
    description="BLS: preprocess, then classifier and embedder concurrently; top-5 + embedding",
)
TAG_PIPELINE = ModelSpec(
    name="tag_pipeline",
    backend="python",
    inputs=(TOKENS,),
    outputs=(TAGS, TAG_PROBS),
    max_batch_size=4,
    batching=_BLS_BATCHING,
    kind="KIND_CPU",
    parameters={
        # The tagger with its reduction in the graph (`tagger` also works: the orchestrator then
        # reduces the 28.7 MB of logits per sequence itself, measured slower).
        "tagger_model": "tagger_tags",
        "tagger_timeout_ms": "0",
        "default_deadline_ms": "10000",
        "max_inflight_requests": "256",
        # With a LOGITS tagger as the stage model, each response holding 28.7 MB per sequence
        # sits in this stub's shared memory until reduced: the thread count bounds that
        # (8 x 4 x 28.7 MB at most).
        "subrequest_threads": "8",
    },
    description="BLS: tagger, reduced on the server to per-token argmax and its probability",
)
PIPELINE_ENSEMBLE = ModelSpec(
    name="pipeline_ensemble",
    backend="",
    platform="ensemble",
    inputs=(IMAGE,),
    outputs=(CLASS_IDS, CLASS_PROBS, EMBEDDING),
    max_batch_size=16,
    batching=None,
    instance_count=0,
    ensemble_steps=(
        EnsembleStep("preprocess", {"IMAGE": "IMAGE"}, {"PIXELS": "pixels"}),
        EnsembleStep("classifier", {"PIXELS": "pixels"}, {"LOGITS": "logits"}),
        EnsembleStep("embedder", {"PIXELS": "pixels"}, {"EMBEDDING": "EMBEDDING"}),
        EnsembleStep("postprocess", {"LOGITS": "logits"},
                     {"CLASS_IDS": "CLASS_IDS", "CLASS_PROBS": "CLASS_PROBS"}),
    ),
    description="Ensemble computing what `pipeline` computes (the benchmark's baseline)",
)

BLS_MODELS: tuple[ModelSpec, ...] = (PIPELINE, TAG_PIPELINE)
ALL_MODELS: tuple[ModelSpec, ...] = (*ONNX_MODELS, *BLS_MODELS, PIPELINE_ENSEMBLE)

# Each orchestrator's stages and, per stage, the contracts a stage model may meet (the sub-model
# specs whose tensors it must have), the default model's first. The tagger stage takes either a
# model that reduces in its graph (TAGS, TAG_PROBS) or one that returns LOGITS, which the
# orchestrator then reduces itself.
STAGES: dict[str, dict[str, tuple[ModelSpec, ...]]] = {
    "pipeline": {"preprocess": (PREPROCESS,), "classifier": (CLASSIFIER,), "embedder": (EMBEDDER,)},
    "tag_pipeline": {"tagger": (TAGGER_TAGS, TAGGER)},
}


def default_stage_models(pipeline: str) -> dict[str, str]:
    """Stage -> the model it calls unless its ``<stage>_model`` parameter says otherwise."""
    return {stage: accepted[0].name for stage, accepted in STAGES[pipeline].items()}


# Stage outputs the orchestrator never computes on or returns: they only flow into other stages,
# so with `gpu_tensors: "on"` they stay on the GPU (stage -> output names).
PASS_THROUGH: dict[str, dict[str, tuple[str, ...]]] = {
    "pipeline": {"preprocess": ("PIXELS",)},
    "tag_pipeline": {},
}


def reduces_tags(contract: ModelSpec) -> bool:
    """Whether a tagger-stage model answers with TAGS and TAG_PROBS itself."""
    return {TAGS, TAG_PROBS} <= set(contract.outputs)


def model(name: str) -> ModelSpec:
    for spec in ALL_MODELS:
        if spec.name == name:
            return spec
    raise KeyError(f"no model named '{name}' in the repository spec")
