"""In-process sub-models for the fault-injection and schedule tests: ``preprocess``,
``classifier`` and ``embedder`` whose every output row is a function of its input row alone (so
a test knows each request's exact answer), steered per request through the request id, as the
live fault model is (modelgen/fault_model.py):

* ``<stage>=<ms>`` in a request's id: that stage sleeps so long (a group sleeps its members'
  longest), e.g. ``"r7;classifier=150"``;
* an image whose pixels are all ``POISON`` fails its classifier batch (and, with
  ``poisoned_stages``, those stages' batches) with ONNX Runtime's INVALID_ARGUMENT message, as
  one bad item fails a whole ONNX Runtime batch;
* ``sick``: {stage: error message}: that stage fails every request with that error.
"""

from __future__ import annotations

import time

import numpy as np

from bls_models import pipelines
from bls_models import spec as S
from tests.unit.fake_pb_utils import SubModelError

POISON = 13
ITEM_ERROR = ("onnx runtime error 2: Non-zero status code returned while running Gather node: "
              "indices element out of data bounds")
STAGE_ERROR = ("onnx runtime error 6: Non-zero status code returned while running Conv node. "
               "Name:'conv_1' Status Message: the kernel failed")


def delay_ms(request_id: str, stage: str) -> float:
    """A (possibly coalesced: ids joined with ',') request id's longest delay for ``stage``."""
    longest = 0.0
    for member in request_id.split(","):
        for token in member.split(";"):
            name, _, value = token.partition("=")
            if name == stage:
                longest = max(longest, float(value))
    return longest


class DirectedRowModels:
    def __init__(self, sick: dict[str, str] | None = None,
                 poisoned_stages: tuple[str, ...] = ("classifier",)) -> None:
        self.sick = sick or {}
        self.poisoned_stages = poisoned_stages

    def models(self) -> dict:
        return {"preprocess": self.preprocess, "classifier": self.classifier,
                "embedder": self.embedder}

    def _enter(self, stage: str, request) -> None:
        time.sleep(delay_ms(request.request_id, stage) / 1e3)
        if stage in self.sick:
            raise SubModelError(self.sick[stage])

    def preprocess(self, inputs, request):
        self._enter("preprocess", request)
        image = inputs["IMAGE"]
        value = image.reshape(len(image), -1)[:, 0].astype(np.float32)
        return {"PIXELS": np.broadcast_to(value[:, None, None, None],
                                          (len(image), *S.PIXELS.dims)).copy()}

    def _poisoned(self, stage: str, pixels) -> None:
        if stage in self.poisoned_stages and (pixels[:, 0, 0, 0] == POISON).any():
            raise SubModelError(ITEM_ERROR)

    def classifier(self, inputs, request):
        self._enter("classifier", request)
        self._poisoned("classifier", inputs["PIXELS"])
        value = inputs["PIXELS"][:, 0, 0, 0]
        return {"LOGITS": (np.arange(S.NUM_CLASSES, dtype=np.float32)[None, :]
                           * (1 + (value[:, None] % 7)))}

    def embedder(self, inputs, request):
        self._enter("embedder", request)
        pixels = inputs["PIXELS"]
        self._poisoned("embedder", pixels)
        return {"EMBEDDING": np.repeat(pixels[:, :1, 0, 0], S.EMBEDDING_DIM, axis=1)}


def image_of(value: int, rows: int = 1) -> dict[str, np.ndarray]:
    return {"IMAGE": np.full((rows, *S.IMAGE.dims), value, np.uint8)}


def expected(value: int) -> dict[str, np.ndarray]:
    """What ``pipeline`` answers for ``image_of(value)`` over these models."""
    logits = np.arange(S.NUM_CLASSES, dtype=np.float32)[None, :] * (1 + value % 7)
    ids, probs = pipelines.softmax_top_k(logits)
    return {"CLASS_IDS": ids, "CLASS_PROBS": probs,
            "EMBEDDING": np.full((1, S.EMBEDDING_DIM), value, np.float32)}


CODES = {0: "UNKNOWN", 1: "INTERNAL", 2: "NOT_FOUND", 3: "INVALID_ARG", 4: "UNAVAILABLE",
         5: "UNSUPPORTED", 6: "ALREADY_EXISTS", 7: "CANCELLED"}


def code_of(response) -> str:
    return "SUCCESS" if not response.has_error() else CODES[response.error().code()]


def exact(response, value: int) -> bool:
    outputs = {t.name(): t.as_numpy() for t in response.output_tensors}
    return all(np.array_equal(outputs[name], array) for name, array in expected(value).items())


def value_of(request) -> int | None:
    """The value of a request made with ``image_of`` (every pixel of every row the same)."""
    if "IMAGE" not in request._sent:
        return None
    image = request.input("IMAGE")
    first = int(image.flat[0])
    return first if image.size and (image == first).all() else None


def expect_exact(pb, poisoned_stages: tuple[str, ...] = ("classifier",)) -> None:
    """Hold ``pb``'s check to each request getting exactly ``expected`` of its image (its
    requested outputs, every row), and INVALID_ARG only for a poisoned one."""
    def reference(request):
        value = value_of(request)
        if value is None or value == POISON:
            return None
        rows = request.input("IMAGE").shape[0]
        wanted = request._outputs or ["CLASS_IDS", "CLASS_PROBS", "EMBEDDING"]
        return {name: np.repeat(array, rows, axis=0)
                for name, array in expected(value).items() if name in wanted}

    def culprit(request):
        value = value_of(request)
        if value is None:
            return None
        wanted = request._outputs or ["CLASS_IDS", "CLASS_PROBS", "EMBEDDING"]
        through = {"classifier": {"CLASS_IDS", "CLASS_PROBS"}, "embedder": {"EMBEDDING"}}
        return value == POISON and any(through[stage] & set(wanted)
                                       for stage in poisoned_stages)

    pb.expect(reference, culprit)
