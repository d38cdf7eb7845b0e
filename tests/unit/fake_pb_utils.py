"""A stand-in for ``triton_python_backend_utils`` with just what ``bls_models.triton_runtime`` uses,
and in-process sub-models behind ``InferenceRequest.exec``: the runtime's threading, deadlines,
counters and exactly-once answers are tested without a server.

``FakePbUtils(models)`` takes ``{model name: function(inputs, request) -> outputs}``; a function
may sleep (a slow sub-model), raise ``SubModelError`` (an error response), or read
``request.request_id`` to be steered per request. Every response a request's sender sends is
recorded on it, so a test can count them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np


class SubModelError(Exception):
    """Raised by a fake sub-model: the sub-request comes back with this error message."""


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, \
        CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None) -> None:
        self.output_tensors = list(output_tensors or [])
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


@dataclass
class Sender:
    """A request's response sender: records what is sent; ``cancelled`` is what the client did."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    sent: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def send(self, response, flags=0) -> None:
        self.sent.append(response)
        self.done.set()

    asked: int = 0  # is_cancelled() calls: each is an IPC round trip in the real stub

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled.is_set()


class Request:
    """A client request as ``execute`` receives it."""

    def __init__(self, inputs: dict[str, np.ndarray], request_id: str = "",
                 timeout_us: int = 0, outputs=()) -> None:
        self.inputs = {name: Tensor(name, value) for name, value in inputs.items()}
        self._id, self._timeout, self._outputs = request_id, timeout_us, list(outputs)
        self.sender = Sender()

    def request_id(self) -> str:
        return self._id

    def timeout(self) -> int:
        return self._timeout

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def get_response_sender(self) -> Sender:
        return self.sender


class _Metric:
    """A series: exported (at 0) from the moment it is created, as Triton's registry does."""

    def __init__(self, registry, key) -> None:
        self.registry, self.key = registry, key
        registry.setdefault(key, 0.0)

    def increment(self, value) -> None:
        self.registry[self.key] = self.registry.get(self.key, 0.0) + value


class FakePbUtils:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    TRITONSERVER_MEMORY_CPU, TRITONSERVER_MEMORY_GPU = 0, 2
    TritonError = TritonError
    Tensor = Tensor
    InferenceResponse = InferenceResponse

    def __init__(self, models: dict) -> None:
        self.models = models
        self.metrics: dict[tuple, float] = {}   # (family, *sorted labels) -> value
        self.log: list[str] = []
        self.calls: list[tuple[str, str]] = []  # (model, request id) of every sub-request sent
        # (model, preferred_memory) of every sub-request sent; None: not given (Triton's default,
        # the producing instance's memory)
        self.output_memory: list[tuple[str, tuple | None]] = []
        fake = self

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind) -> None:
                self.name = name

            def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
                return _Metric(fake.metrics, (self.name, *sorted(labels.items())))

        class Logger:
            @staticmethod
            def log_info(message):
                fake.log.append(message)

            log_error = log_warn = log_info

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names, request_id="",
                         timeout=0, preferred_memory=None, **_) -> None:
                self.model, self.inputs = model_name, {t.name(): t.as_numpy() for t in inputs}
                self.outputs, self.request_id = list(requested_output_names), request_id
                self.timeout, self.preferred_memory = timeout, preferred_memory

            def exec(self):
                fake.calls.append((self.model, self.request_id))
                fake.output_memory.append((self.model, self.preferred_memory))
                function = fake.models.get(self.model)
                if function is None:
                    return InferenceResponse(error=TritonError(
                        f"Failed for execute the inference request. Model '{self.model}' is "
                        "not ready."))
                try:
                    outputs = function(self.inputs, self)
                except SubModelError as error:
                    return InferenceResponse(error=TritonError(str(error)))
                return InferenceResponse(output_tensors=[Tensor(n, outputs[n])
                                                         for n in self.outputs if n in outputs])

        self.MetricFamily, self.Logger, self.InferenceRequest = MetricFamily, Logger, InferenceRequest

    @staticmethod
    def PreferredMemory(kind, device):  # noqa: N802 - pb_utils' name
        return (kind, device)

    @staticmethod
    def get_input_tensor_by_name(request: Request, name: str) -> Tensor | None:
        return request.inputs.get(name)

    @staticmethod
    def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
        return next((t for t in response.output_tensors if t.name() == name), None)

    def metric(self, family: str, **labels: str) -> float:
        """Sum of ``family``'s series whose labels include ``labels``."""
        return sum(value for (name, *found), value in self.metrics.items()
                   if name == family and set(labels.items()) <= set(found))
