"""The orchestrators' error model: what went wrong, where, and which status the client gets.

Every failure of a pipeline request ends as one ``PipelineError`` with a ``code`` (a Triton error
code name), the ``stage`` and sub-``model`` involved, and a short message for the client — never
a traceback (the server log gets that). ``classify_sub_error`` is the one place that turns a
sub-model's error message into a kind: Triton 2.51 (python_backend r24.10) delivers every BLS
sub-request error with code INTERNAL, so the message is all there is to go on.
"""

from __future__ import annotations

import re
from enum import Enum


class Code(str, Enum):
    """Triton error codes (``pb_utils.TritonError.<name>``) the orchestrators answer with."""

    INVALID_ARG = "INVALID_ARG"    # the client sent something unusable      -> HTTP 400
    UNAVAILABLE = "UNAVAILABLE"    # overload, full queue, deadline: retry    -> HTTP 503
    CANCELLED = "CANCELLED"        # the client went away
    INTERNAL = "INTERNAL"          # a sub-model or the orchestrator failed   -> HTTP 500


class Kind(str, Enum):
    """Why a sub-request failed (the ``kind`` label of ``bls_subrequest_errors_total``)."""

    DEADLINE = "deadline"          # the request's deadline or a stage timeout passed
    QUEUE_FULL = "queue_full"      # the sub-model's queue is at max_queue_size
    NOT_READY = "not_ready"        # the sub-model is not loaded / not ready
    SHM = "shm"                    # the python backend could not grow its shared memory
    MEMORY = "out_of_memory"       # the sub-model ran out of host or device memory: retry
    INVALID = "invalid"            # the sub-model rejected the data
    CANCELLED = "cancelled"        # cancelled (client cancellation or unload)
    FAILED = "failed"              # anything else: the sub-model failed
    INTERNAL = "internal"          # the orchestrator's own code failed in the stage (never a
                                   # sub-model's answer: never classified, never isolated)


KIND_CODES = {
    Kind.DEADLINE: Code.UNAVAILABLE,
    Kind.QUEUE_FULL: Code.UNAVAILABLE,
    Kind.NOT_READY: Code.UNAVAILABLE,
    Kind.SHM: Code.UNAVAILABLE,
    Kind.MEMORY: Code.UNAVAILABLE,
    Kind.INVALID: Code.INVALID_ARG,
    Kind.CANCELLED: Code.CANCELLED,
    Kind.FAILED: Code.INTERNAL,
    Kind.INTERNAL: Code.INTERNAL,
}

# What a sub-request's error message means, by the rule that names its source: Triton 2.51's core
# (r24.10), python backend (r24.10 @ 01d0ad82), onnxruntime backend (r24.10, ONNX Runtime's
# status as "onnx runtime error <OrtErrorCode>: ...", onnxruntime_utils.h 51-53) and tensorrt
# backend (r24.10 @ ffcbe0b5). r24.10 hands every BLS error over as INTERNAL with its message
# only (request_executor.cc 90, 152; pb_error.h 43-45), so the message decides: each rule
# matches the words of one source's own message, never a word that could appear in another's.
# The first rule that matches wins; none: FAILED. docs/orchestrator.md ("Errors") has the table
# with every message; tests/unit/test_orchestration.py a case per row.
_RULES: tuple[tuple[str, Kind], ...] = (
    # core, before or in the queue
    (r"request timeout expired", Kind.DEADLINE),                 # dynamic_batch_scheduler.cc 71
    (r"exceeds maximum queue size", Kind.QUEUE_FULL),            # scheduler_utils.cc 172-176
    (r"server is stopping|server not ready|is not at ready state", Kind.NOT_READY),  # 187-192;
                                                          # server.cc 455-457; model_lifecycle 384
    (r"request for unknown model|has no available versions", Kind.NOT_READY),  # m_r_manager 1237
    # python backend: a sub-model missing or not ready (the two read alike: server.cc 450-472)
    (r"failed for execute the inference request\. model '.*' is not ready", Kind.NOT_READY),
    (r"failed to increase the shared memory pool size", Kind.SHM),       # shm_manager.cc 186-196
    # A device or its memory failed: never the client's, whatever ONNX Runtime's code says.
    # Out of memory is retryable (ORT's BFC arena; cudaMalloc as "CUDA failure 2: out of memory").
    (r"failed to allocate memory for requested buffer|cuda failure 2: out of memory",
     Kind.MEMORY),
    # cuda_call.cc "<lib> failure N: ..."; cuda_kernel.h "CUDA error cudaError...:..." (ORT code 1
    # or 6: onnxruntime#23149, server#7296); TensorRT enqueue and CUDA graph failures
    # (instance_state.cc 895-940); CUDA copies (core cuda_utils.cc 155-157)
    (r"(cuda|cublas|cudnn|curand|cufft) failure \d+:|cuda error cudaerror\w*:"
     r"|illegal memory access|device-side assert|unable to enqueue for inference"
     r"|unable to execute graph for inference|failed to perform cuda copy", Kind.FAILED),
    # core's check of a request against the model's config (infer_request.cc 1080-1402,
    # model.cc 46-48): the data the pipeline sent for its rows
    (r"unexpected shape for input|data-type is '.*', but model '.*' expects"
     r"|missing required input|batch-size must be <=|all input dimensions should be specified"
     r"|input byte size mismatch|unexpected inference input|string length indicator"
     r"|string elements for inference input", Kind.INVALID),
    # ONNX Runtime's ORT_INVALID_ARGUMENT (2): its checks of the values it was fed (a Gather
    # index out of bounds, a rank or dimension the graph does not take). Codes 1 (FAIL), 6
    # (RUNTIME_EXCEPTION), 11 (EP_FAIL), ... are the model's or the device's.
    (r"onnx runtime error 2:", Kind.INVALID),
    # TensorRT: a shape outside the engine's optimization profile (tensorrt_utils.cc 318-336,
    # instance_state.cc 3849-3857) or bad shape-tensor values (tensorrt_utils.cc 375-392)
    (r"request specifies invalid shape for input|mismatch between the (number|datatypes) of "
     r"shape values", Kind.INVALID),
)
_COMPILED = tuple((re.compile(pattern), kind) for pattern, kind in _RULES)


def classify_sub_error(message: str) -> Kind:
    """The kind of a sub-request error, from its message (codes are lost in r24.10)."""
    text = message.lower()
    return next((kind for pattern, kind in _COMPILED if pattern.search(text)), Kind.FAILED)


class PipelineError(Exception):
    """A request's failure, ready to be sent to the client as ``TritonError(message, code)``."""

    def __init__(self, code: Code, message: str, *, stage: str = "", model: str = "",
                 kind: Kind | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.stage = stage
        self.model = model
        self.kind = kind

    @property
    def message(self) -> str:
        return str(self)


class InvalidInput(PipelineError):
    def __init__(self, message: str) -> None:
        super().__init__(Code.INVALID_ARG, message, kind=Kind.INVALID)


class DeadlineExceeded(PipelineError):
    def __init__(self, stage: str, model: str, budget_ms: float, limit: str = "deadline") -> None:
        super().__init__(
            Code.UNAVAILABLE,
            f"deadline exceeded in stage '{stage}' (model '{model}'): {limit} of "
            f"{budget_ms:.0f} ms passed",
            stage=stage, model=model, kind=Kind.DEADLINE)


def internal_error(model: str, stage: str = "") -> PipelineError:
    """What the client hears of a failure of the orchestrator's own code (its run function, its
    runtime, a ``reduce``): short, naming the stage when there is one; the details go to the
    server log only."""
    where = f" in stage '{stage}'" if stage else ""
    return PipelineError(Code.INTERNAL,
                         f"internal error in orchestrator '{model}'{where} (see the server log)",
                         stage=stage, kind=Kind.INTERNAL)


class Cancelled(PipelineError):
    def __init__(self, stage: str) -> None:
        super().__init__(Code.CANCELLED, f"request cancelled before stage '{stage}'",
                         stage=stage, kind=Kind.CANCELLED)


def sub_request_failed(stage: str, model: str, message: str) -> PipelineError:
    """The client-facing error for a sub-request that came back with an error."""
    kind = classify_sub_error(message)
    if kind is Kind.DEADLINE:
        text = f"deadline exceeded in stage '{stage}' (model '{model}'): {first_line(message)}"
    else:
        text = f"stage '{stage}' (model '{model}') failed: {first_line(message)}"
    return PipelineError(KIND_CODES[kind], text, stage=stage, model=model, kind=kind)


def first_line(message: str, limit: int = 300) -> str:
    """One short line of a possibly long, multi-line error message."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."
