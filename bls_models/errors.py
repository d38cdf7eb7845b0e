"""The orchestrators' error model: what went wrong, where, and which status the client gets.

Every failure of a pipeline request ends as one ``PipelineError`` with a ``code`` (a Triton error
code name), the ``stage`` and sub-``model`` involved, and a short message for the client — never
a traceback (the server log gets that). ``classify_sub_error`` is the one place that turns a
sub-model's error message into a kind: Triton 2.51 (python_backend r24.10) delivers every BLS
sub-request error with code INTERNAL, so the message is all there is to go on.
"""

from __future__ import annotations

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
    Kind.INVALID: Code.INVALID_ARG,
    Kind.CANCELLED: Code.CANCELLED,
    Kind.FAILED: Code.INTERNAL,
    Kind.INTERNAL: Code.INTERNAL,
}

# Message fragments of Triton 2.51 (core r24.10, python_backend r24.10, the C++ onnxruntime
# backend r24.10 over ONNX Runtime), first match wins. Keep lower case. Each was seen on a BLS
# sub-request to a real sub-model on the real backend (tests/live/test_backend_errors.py).
_PATTERNS: tuple[tuple[str, Kind], ...] = (
    ("request timeout expired", Kind.DEADLINE),                   # queue policy timeout
    ("exceeds maximum queue size", Kind.QUEUE_FULL),              # max_queue_size
    ("failed to increase the shared memory pool size", Kind.SHM),
    ("is not ready", Kind.NOT_READY),                             # unknown / unloaded model
    ("is not found", Kind.NOT_READY),
    ("cancelled", Kind.CANCELLED),
    ("canceled", Kind.CANCELLED),
    # Triton core refuses the request before any backend runs it:
    ("unexpected shape for input", Kind.INVALID),
    ("data-type is", Kind.INVALID),                               # "... but model 'm' expects"
    ("missing required input", Kind.INVALID),
    # The onnxruntime backend reports ONNX Runtime's status as "onnx runtime error <code>: ...";
    # code 2 is ORT_INVALID_ARGUMENT (the data, e.g. an index out of a table). Other codes
    # (1 FAIL, 6 RUNTIME_EXCEPTION, ...) are the model's failure.
    ("onnx runtime error 2:", Kind.INVALID),
    ("invalid_argument", Kind.INVALID),                           # ONNX Runtime's status name
    ("invalid argument", Kind.INVALID),
    ("out of bounds", Kind.INVALID),
)


def classify_sub_error(message: str) -> Kind:
    """The kind of a sub-request error, from its message (codes are lost in r24.10)."""
    text = message.lower()
    for fragment, kind in _PATTERNS:
        if fragment in text:
            return kind
    return Kind.FAILED


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


def shutting_down(model: str) -> PipelineError:
    return PipelineError(Code.UNAVAILABLE, f"model '{model}' is shutting down")


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
