"""The contract of every model in the repository: one source of truth.

Tensor names, dtypes and shapes defined here are used by the ONNX exporter (``modelgen``),
by the ``config.pbtxt`` generator, by the orchestrators and by the tests. Nothing here imports
Triton, numpy or torch, so the orchestrators can use it inside the python-backend stub and the
unit tests can use it anywhere.

Shapes never include the batch dimension: every model here batches (``max_batch_size > 0``)
and Triton prepends the batch axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ImageNet normalisation applied by `preprocess`.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SIZE = 224

# The tagger's vocabulary and sequence length (the "28 MB output" case: 512 x 14041 x 4 bytes).
TAGGER_VOCAB = 14041
TAGGER_SEQ_LEN = 512

NUM_CLASSES = 1000
EMBEDDING_DIM = 256


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
class ModelSpec:
    name: str
    backend: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    batching: BatchingSpec
    # Instances per device (KIND_AUTO: one group of `instance_count` on each GPU in the container,
    # CPU instances locally). At least 2 wherever a queue policy is set: with a single instance
    # the dynamic batcher's policy queue stalled in ~500 ms steps under bursts (measured).
    instance_count: int = 2
    parameters: dict[str, str] = field(default_factory=dict)
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

# Starting values; the benchmark (`make bench`) re-tunes delays, preferred sizes and counts.
_CNN_BATCHING = BatchingSpec(preferred_batch_sizes=(4, 8), max_queue_delay_us=500)

PREPROCESS = ModelSpec(
    name="preprocess",
    backend="onnxruntime",
    inputs=(IMAGE,),
    outputs=(PIXELS,),
    max_batch_size=16,
    batching=_CNN_BATCHING,
    description="UINT8 HWC image -> ImageNet-normalised FP32 CHW pixels",
)
CLASSIFIER = ModelSpec(
    name="classifier",
    backend="onnxruntime",
    inputs=(PIXELS,),
    outputs=(CLASS_LOGITS,),
    max_batch_size=16,
    batching=_CNN_BATCHING,
    description="ResNet-style CNN, 1000 class logits",
)
EMBEDDER = ModelSpec(
    name="embedder",
    backend="onnxruntime",
    inputs=(PIXELS,),
    outputs=(EMBEDDING,),
    max_batch_size=16,
    batching=_CNN_BATCHING,
    description="Depthwise-separable CNN, L2-normalised 256-d embedding",
)
TAGGER = ModelSpec(
    name="tagger",
    backend="onnxruntime",
    inputs=(TOKENS,),
    outputs=(TAG_LOGITS,),
    # One item's output is 28.7 MB: keep batches small so a batch stays well inside shm.
    max_batch_size=4,
    batching=BatchingSpec(preferred_batch_sizes=(2, 4), max_queue_delay_us=500, max_queue_size=64),
    description="Token tagger with a 512 x 14041 logits output (the large-output case)",
)

ONNX_MODELS: tuple[ModelSpec, ...] = (PREPROCESS, CLASSIFIER, EMBEDDER, TAGGER)

ALL_MODELS: tuple[ModelSpec, ...] = ONNX_MODELS


def model(name: str) -> ModelSpec:
    for spec in ALL_MODELS:
        if spec.name == name:
            return spec
    raise KeyError(f"no model named '{name}' in the repository spec")
