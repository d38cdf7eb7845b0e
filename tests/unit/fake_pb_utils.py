"""A stand-in for ``triton_python_backend_utils`` that behaves like python_backend r24.10 where the
orchestrator runtime's guarantees depend on it, with in-process sub-models behind
``InferenceRequest.exec``: the runtime's threading, deadlines, counters and exactly-once answers
are tested without a server.

``FakePbUtils(models)`` takes ``{model name: function(inputs, request) -> outputs}``; a function
may sleep (a slow sub-model), raise ``SubModelError`` (an error response), or read
``request.request_id`` to be steered per request.

What it holds to, as r24.10 does (source files of triton-inference-server/python_backend r24.10):

* **One final response per sender** (``response_sender.cc``, ``UpdateStateAndCounters``): the
  first ``send`` with ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` closes the sender *before* the
  response crosses to the server, so a send that then fails has closed it all the same; any
  later ``send`` raises "Response sender has been closed". ``is_cancelled`` on a closed sender
  is a violation: the server has deleted the response factory it would ask about.
* **The stub's side of execute** (``pb_stub.cc``, ``ProcessRequests``): drive the model with
  ``fake.execute(model, requests)``. If ``execute`` raises, r24.10 answers every request not
  yet closed with an error and the backend deletes every response factory, answered ones
  included (a double free inside tritonserver): the errors are recorded as answers and the
  raise as a violation. A returned list must hold one entry per request, ``None`` or an
  ``InferenceResponse`` for a request whose sender was never used; a decoupled model
  (``decoupled=True``) must return ``None``. When ``execute`` returns, the requests are
  released: their tensors' memory is overwritten and any further use of a request raises.
  A request input's ``as_numpy()`` is a view of the request's memory (r24.10 hands out a copy:
  the runtime must copy what it keeps unless the array owns its memory).
* **Finalize** (``fake.finalize(model)``): from its start, ``exec`` raises "BLS is only
  supported during the 'execute' function." as r24.10's does (``Stub::Finalize`` sets
  ``finalizing_`` before calling the model's ``finalize``: ``infer_request.cc``).
* **Faults.** ``fake.faults.plan(name, "once" | "always", after=k)`` makes the named call raise
  ``InjectedFault`` (once: the first call after ``k`` unaffected ones). Names:
  ``get_input_tensor_by_name``, ``as_numpy`` (of a request's input), ``get_response_sender``,
  ``request_id``, ``timeout``, ``requested_output_names``, ``Tensor``, ``from_dlpack``,
  ``InferenceRequest``,
  ``exec``, ``get_output_tensor_by_name``, ``InferenceResponse``, ``TritonError``, ``send``,
  ``is_cancelled``, ``metric`` (creating or incrementing a metric) and ``Logger``. The fake's
  own sub-models build their responses without the faults.
* **Where a sub-response's outputs live** (``FakePbUtils(models, gpu=...)``: the sub-models
  whose instances are KIND_GPU). A sub-request that names no ``preferred_memory`` gets its
  outputs where the producing instance put them: in GPU memory for a KIND_GPU model, as
  r24.10's BLS response allocator leaves them (see ``_GpuTensor`` for the source lines). Such a
  tensor answers ``is_cpu()`` False, refuses ``as_numpy()`` as r24.10 does, and crosses to the
  next sub-request only by ``to_dlpack`` / ``Tensor.from_dlpack`` (a capsule is consumed once).
  ``PreferredMemory(TRITONSERVER_MEMORY_CPU, 0)`` brings them to host memory. Freeing one is an
  object call: it must happen under ``object_lock`` when a test sets it.
* **After finalize** returned, every pb_utils call is a violation.
* **Answers owed past execute** (r24.10: a ``None`` entry leaves the request's response factory
  open, ``python_be.cc`` 1395-1396 and 1421-1423; the stub keeps the sender while Python holds
  the request): such a request may still be asked ``get_response_sender`` and ``is_cancelled``
  and answered through its sender from any thread; anything else is a violation (its memory is
  released). At most the model's ``max_owed_answers`` may be owed at once (each is lost if the
  stub dies); ``request.answers`` waits for an owed answer as a client would.
* **The runtime's invariants** (bls_models/triton_runtime.py), checked by ``check()`` after every
  unit test (tests/unit/conftest.py): every request handed to ``execute`` got exactly one final
  answer; no answer came later than its deadline + ``DEADLINE_SLACK``; no
  sub-request was made for requests that were all answered already (a closed group sends
  nothing more); and, where a test says what each request must get (``expect``), a success
  carries exactly its own rows' outputs and INVALID_ARG goes only to a request that is bad.
* **One thread at a time in pb_utils' object calls** (creating, reading or freeing a request's
  tensors, ``Tensor``, ``InferenceRequest``, ``InferenceResponse``, ``TritonError``, the log):
  two threads inside them at once is a violation (stubs crashed that way under bursts).
* **No lock across a round trip.** ``fake.forbidden_locks`` lists locks that must not be held by
  the calling thread during ``send``, ``is_cancelled`` and metric increments (each an IPC round
  trip to the server in r24.10).

``fake.violations`` lists every broken rule; tests assert it stays empty.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

# How late an answer may come past its deadline on a busy 2-core host (docs/reliability.md).
DEADLINE_SLACK = 0.5


class SubModelError(Exception):
    """Raised by a fake sub-model: the sub-request comes back with this error message."""


class InjectedFault(RuntimeError):
    """What a pb_utils call raises when a test planned a fault for it."""


class Faults:
    """Which calls raise. Thread-safe: the runtime calls pb_utils from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, tuple[str, int]] = {}
        self.calls: Counter[str] = Counter()
        self.raised: Counter[str] = Counter()

    def plan(self, name: str, how: str, after: int = 0) -> None:
        assert how in ("once", "always"), how
        with self._lock:
            self._plans[name] = (how, self.calls[name] + after)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def check(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1
            plan = self._plans.get(name)
            if plan is None:
                return
            how, first = plan
            if self.calls[name] <= first or (how == "once" and self.raised[name]):
                return
            self.raised[name] += 1
        raise InjectedFault(f"injected fault in {name}")


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, \
        CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """What pb_utils raises for a failed call into the stub (pybind11 translates r24.10's
    ``PythonBackendException`` to ``pb_utils.TritonModelException``: ``pb_stub.cc``)."""


class Tensor:
    def __init__(self, name: str, array) -> None:
        array = np.asarray(array)
        if array.dtype == object:  # pybind11 cannot make a tensor of it (r24.10 ``pb_stub.cc``)
            raise TritonModelException(f"Unsupported tensor data for '{name}': {type(array)}")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> "_Capsule":
        return _Capsule(self._array, None)

    @staticmethod
    def from_dlpack(name: str, capsule) -> "Tensor":
        """r24.10 ``PbTensor::FromDLPack`` (``pb_tensor.cc``): a tensor over the capsule's memory,
        on its device; the capsule is consumed (DLPack: at most once)."""
        array, device = capsule.consume()
        if not array.flags.c_contiguous:
            raise TritonModelException("DLPack tensor is not contiguous. Only contiguous DLPack "
                                       "tensors that are stored in C-Order are supported.")
        return Tensor(name, array) if device is None else _GpuTensor(name, array, device)


class _Capsule:
    """A DLPack capsule: memory and its device (None: the host); usable once."""

    def __init__(self, array: np.ndarray, device) -> None:
        self._array, self._device, self._used = array, device, False

    def consume(self):
        if self._used:
            raise TritonModelException("DLPack capsule was already consumed")
        self._used = True
        return self._array, self._device


class _GpuTensor(Tensor):
    """A tensor in GPU memory, as r24.10 hands one out (python_backend r24.10, 01d0ad82):

    * a BLS sub-request names no memory unless asked (``preferred_memory`` defaults to
      ``kDefault``, ``src/pb_stub.cc`` 1777-1778); the response allocator then uses the memory
      the producing backend asks for (``src/request_executor.cc`` 205-208), which for the
      onnxruntime backend on a KIND_GPU instance is its GPU (onnxruntime_backend r24.10
      ``src/onnxruntime.cc`` 2017-2022, 2080-2087); a named memory overrides it (209-216).
      Triton's own QA asserts ``not output.is_cpu()`` there (server r24.10
      ``qa/python_models/bls_onnx_warmup/model.py`` 58-60);
    * ``is_cpu()`` is false (``src/pb_tensor.cc`` 181-190); ``as_numpy()`` raises
      ``TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")``
      (518-520; the exception registered at ``src/pb_stub.cc`` 1964-1965);
    * ``to_dlpack()`` hands out the same memory, no copy, for CPU and GPU tensors alike
      (273-316); ``Tensor.from_dlpack`` takes it, C-contiguous only, on the capsule's device,
      and renames the capsule "used_dlpack": it is consumed (342-499);
    * ``pb_utils.Tensor(name, array)`` builds CPU tensors only, from numpy (47-86, 237-241).
    """

    fake: "FakePbUtils | None" = None

    def __init__(self, name: str, array, device: int, fake=None) -> None:
        self._name, self._array, self._device = name, np.asarray(array), device
        self.fake = fake

    def as_numpy(self) -> np.ndarray:
        raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")

    def is_cpu(self) -> bool:
        return False

    def to_dlpack(self) -> _Capsule:
        return _Capsule(self._array, self._device)

    def __del__(self) -> None:
        fake = self.fake
        if fake is not None and not fake.finalized:
            fake.freed(f"GPU tensor '{self._name}'")


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
    """A request's response sender, as r24.10's for a model that is not decoupled.

    ``sent`` holds the responses that reached the client, ``attempts`` every send the sender
    accepted (a failed one included); ``cancelled`` is what the client did."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    sent: list = field(default_factory=list)
    attempts: int = 0
    closed: bool = False
    done: threading.Event = field(default_factory=threading.Event)  # closed: answered or lost
    answered_at: float | None = None
    asked: int = 0  # is_cancelled() calls: each is an IPC round trip in the real stub
    fetched: bool = False  # get_response_sender() was called
    delay: float = 0.0  # seconds a send takes (a slow round trip to the server)
    fake: "FakePbUtils | None" = None
    request: "Request | None" = None

    def send(self, response=None, flags=0) -> None:
        fake = self.fake
        if fake is not None:
            fake.enter("send", ipc=True)
        if flags != FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL or response is None:
            raise RuntimeError("this runtime must send one final response with its tensors")
        with _SENDER_LOCK:
            if self.closed:
                if fake is not None:
                    fake.violation("a second send on a closed response sender")
                raise RuntimeError("Unable to send response. Response sender has been closed.")
            self.closed, self.attempts = True, self.attempts + 1
            self.answered_at = time.monotonic()
        try:
            if fake is not None:
                fake.faults.check("send")  # after the sender closed, as in r24.10
            if self.delay:
                time.sleep(self.delay)
            self.sent.append(response)
        finally:
            self.done.set()

    def is_cancelled(self) -> bool:
        fake = self.fake
        if fake is not None:
            fake.enter("is_cancelled", ipc=True)
            if self.closed:
                fake.violation("is_cancelled() on a closed response sender")
            fake.faults.check("is_cancelled")
        self.asked += 1
        return self.cancelled.is_set()


_SENDER_LOCK = threading.Lock()
# What a request owed past execute may still be asked (r24.10: its response factory lives until
# the final send; ``is_cancelled`` asks the factory, python_be.cc 868-875).
_OWED_CALLS = ("get_response_sender", "is_cancelled")
OWED_WAIT = 10.0


def _foreign(value: np.ndarray) -> np.ndarray:
    """A copy of ``value`` over a bytearray: an array that does not own its memory."""
    return np.frombuffer(bytearray(value.tobytes()), value.dtype).reshape(value.shape)


class Request:
    """A client request as ``execute`` receives it."""

    def __init__(self, inputs: dict[str, np.ndarray], request_id: str = "",
                 timeout_us: int = 0, outputs=()) -> None:
        # The request's memory, not numpy's (as shared memory is): a runtime that keeps an
        # input must copy it (``Backend.owns_memory`` says it does not own it).
        self._buffers = {name: _foreign(np.asarray(value)) for name, value in inputs.items()}
        self._sent = {name: np.array(value, copy=True) for name, value in inputs.items()}
        self._id, self._timeout, self._outputs = request_id, timeout_us, list(outputs)
        self.sender = Sender()
        self.sender.request = self
        self.returned = None  # a response execute returned for it
        self.released = False
        self.fake: FakePbUtils | None = None
        self.executed_at: float | None = None  # when execute was called with it
        self.deadline_s: float | None = None   # its deadline, from then

    # What the tests read (not a pb_utils call).
    def input(self, name: str) -> np.ndarray:
        """What the client sent (the request's own memory is overwritten at release)."""
        return self._sent[name]

    @property
    def answers(self) -> list:
        """The responses that reached the client: sent, or returned from execute. An answer
        owed past execute is waited for (up to OWED_WAIT seconds), as its client would."""
        if self.owed:
            self.sender.done.wait(OWED_WAIT)
        return self.sender.sent + ([self.returned] if self.returned is not None else [])

    @property
    def owed(self) -> bool:
        """Left unanswered by execute's list, its sender got and still open: answered later or
        lost (a sender never got leaves nothing to answer with)."""
        return (self.released and self.returned is None and not self.sender.closed
                and self.sender.fetched)

    @property
    def answer(self):
        """The one response that reached the client (fails if there are none or several)."""
        (response,) = self.answers
        return response

    @property
    def answer_attempts(self) -> int:
        return self.sender.attempts + (self.returned is not None)

    def _use(self, name: str, ipc: bool = False) -> None:
        if self.fake is not None:
            self.fake.enter(name, ipc=ipc)
            if self.released and not (self.owed and name in _OWED_CALLS):
                self.fake.violation(f"request.{name}() after execute returned")
                raise RuntimeError("the request was released when execute returned")
            self.fake.faults.check(name)

    def request_id(self) -> str:
        self._use("request_id")
        return self._id

    def timeout(self) -> int:
        self._use("timeout")
        return self._timeout

    def requested_output_names(self) -> list[str]:
        self._use("requested_output_names")
        return list(self._outputs)

    def get_response_sender(self) -> Sender:
        self._use("get_response_sender")
        self.sender.fetched = True
        return self.sender

    def is_cancelled(self) -> bool:
        """A round trip to the server (r24.10 ``pb_cancel.cc``); only while the request lives."""
        self._use("is_cancelled", ipc=True)
        self.sender.asked += 1
        return self.sender.cancelled.is_set()

    def release(self) -> None:
        """What r24.10 does when execute returns: the request's memory goes back to the pool."""
        self.released = True
        for buffer in self._buffers.values():
            buffer.view(np.uint8)[...] = 0xA5


class _InputTensor:
    """A request input: a view of the request's memory, unusable once the request is released."""

    def __init__(self, request: Request, name: str) -> None:
        self._request, self._name = request, name

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        self._request._use("as_numpy")
        return self._request._buffers[self._name]

    def is_cpu(self) -> bool:
        return True


class _Metric:
    """A series: exported (at 0) from the moment it is created, as Triton's registry does."""

    def __init__(self, fake, key) -> None:
        self.fake, self.key = fake, key
        fake.metrics.setdefault(key, 0.0)

    def increment(self, value) -> None:
        self.fake.enter("metric", ipc=True)
        self.fake.faults.check("metric")
        with self.fake.state:
            self.fake.metrics[self.key] = self.fake.metrics.get(self.key, 0.0) + value


@dataclass
class SentSubRequest:
    """A sub-request as ``exec`` saw it."""

    model: str
    request_id: str
    timeout_us: int
    started: float
    rows: int


class FakePbUtils:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    TRITONSERVER_MEMORY_CPU, TRITONSERVER_MEMORY_GPU = 0, 2

    def __init__(self, models: dict, gpu=()) -> None:
        self.models = models
        self.gpu = frozenset(gpu)  # sub-models whose instances are KIND_GPU
        self.object_lock = None  # a lock every object call must be made under (None: any)
        self.faults = Faults()
        self.state = threading.Lock()
        self.metrics: dict[tuple, float] = {}   # (family, *sorted labels) -> value
        self.log: list[str] = []
        self.calls: list[tuple[str, str]] = []  # (model, request id) of every sub-request sent
        self.sent: list[SentSubRequest] = []
        # (model, preferred_memory) of every sub-request sent; None: not given (Triton's default,
        # the producing instance's memory)
        self.output_memory: list[tuple[str, tuple | None]] = []
        self.violations: list[str] = []
        self.owed: dict[int, list] = {}  # per model instance: its requests owed past execute
        self.executed: list[Request] = []       # every request handed to execute
        self.by_id: dict[str, Request] = {}     # those with a unique id
        self._inside: dict[int, str] = {}      # thread -> the object call it is in
        self.reference = None  # request -> the outputs it must get (None: not known)
        self.culprit = None    # request -> whether it is bad (INVALID_ARG is its due)
        self.finalizing = False
        self.finalized = False
        self.forbidden_locks: list = []
        fake = self

        class FaultyTensor(Tensor):
            def __init__(self, name, array) -> None:
                fake.enter("Tensor")
                fake.faults.check("Tensor")
                super().__init__(name, array)

            @staticmethod
            def from_dlpack(name, capsule):
                fake.enter("Tensor.from_dlpack")
                fake.faults.check("from_dlpack")
                tensor = Tensor.from_dlpack(name, capsule)
                if isinstance(tensor, _GpuTensor):
                    tensor.fake = fake
                return tensor

        class FaultyResponse(InferenceResponse):
            def __init__(self, output_tensors=None, error=None) -> None:
                fake.enter("InferenceResponse")
                fake.faults.check("InferenceResponse")
                super().__init__(output_tensors, error)

        class FaultyError(TritonError):
            def __init__(self, message, code=1) -> None:
                fake.enter("TritonError")
                fake.faults.check("TritonError")
                super().__init__(message, code)

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind) -> None:
                fake.enter("MetricFamily")
                self.name = name

            def Metric(self, labels, buckets=None):
                fake.enter("metric", ipc=True)
                fake.faults.check("metric")
                return _Metric(fake, (self.name, *sorted(labels.items())))

        class Logger:
            @staticmethod
            def log_info(message):
                fake.enter("Logger")
                fake.faults.check("Logger")
                fake.log.append(message)

            log_error = log_warn = log_info

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names, request_id="",
                         timeout=0, preferred_memory=None, **_) -> None:
                fake.enter("InferenceRequest")
                fake.faults.check("InferenceRequest")
                fake.check_wanted(request_id)
                # What the sub-model reads (Triton copies between devices as its backend asks).
                self.model, self.inputs = model_name, {t.name(): t._array for t in inputs}
                self.outputs, self.request_id = list(requested_output_names), request_id
                self.timeout, self.preferred_memory = timeout, preferred_memory

            def exec(self):
                fake.enter("exec", ipc=True)
                if fake.finalizing:
                    raise RuntimeError("BLS is only supported during the 'execute' function.")
                fake.faults.check("exec")
                rows = len(next(iter(self.inputs.values()))) if self.inputs else 0
                with fake.state:
                    fake.calls.append((self.model, self.request_id))
                    fake.sent.append(SentSubRequest(self.model, self.request_id, self.timeout,
                                                    time.monotonic(), rows))
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
                return InferenceResponse(output_tensors=[fake.output(self, n, outputs[n])
                                                         for n in self.outputs if n in outputs])

        self.Tensor, self.InferenceResponse, self.TritonError = \
            FaultyTensor, FaultyResponse, FaultyError
        self.MetricFamily, self.Logger, self.InferenceRequest = MetricFamily, Logger, InferenceRequest

    def output(self, request, name: str, array) -> Tensor:
        """A sub-response output, in the memory r24.10 gives it: see ``_GpuTensor``."""
        memory = request.preferred_memory
        on_gpu = request.model in self.gpu and (memory is None
                                               or memory[0] == self.TRITONSERVER_MEMORY_GPU)
        return _GpuTensor(name, array, 0, self) if on_gpu else Tensor(name, array)

    def freed(self, what: str) -> None:
        """Backend memory freed: an object call, under ``object_lock`` when one is set."""
        self.enter(f"~{what}")

    # -- the rules -----------------------------------------------------------------------------
    def enter(self, name: str, ipc: bool = False) -> None:
        """Every pb_utils call passes here: none after finalize, no forbidden lock held across a
        round trip to the server."""
        if self.finalized:
            self.violation(f"{name} called after finalize returned")
        if ipc:
            for lock in self.forbidden_locks:
                if _held_by_this_thread(lock):
                    self.violation(f"{name} (a round trip to the server) called holding a lock")
            return
        # An object call (it creates, reads or frees backend memory): r24.10 stubs crashed when
        # two threads made such calls at once (``free(): invalid size``), so none may overlap
        # another thread's. The check yields once inside the call, so that two unserialised
        # threads meet here as they would in the real stub.
        if self.object_lock is not None and not _held_by_this_thread(self.object_lock):
            self.violation(f"{name} made without the backend's lock")
        me = threading.get_ident()
        with self.state:
            others = [n for t, n in self._inside.items() if t != me]
            self._inside[me] = name
        if others:
            self.violation(f"{name} made while another thread was in {others[0]}: pb_utils "
                           "object calls from two threads at once")
        time.sleep(0)
        with self.state:
            self._inside.pop(me, None)

    def check_wanted(self, request_id: str) -> None:
        """A sub-request for client requests that were all answered already is one a closed
        group should not have sent."""
        ids = [i for i in request_id.split(",") if i]
        with self.state:
            known = [self.by_id.get(i) for i in ids]
        if ids and all(r is not None and r.sender.closed for r in known):
            self.violation(f"a sub-request for requests all answered already: {request_id}")

    def expect(self, reference=None, culprit=None) -> None:
        """What each request must get: ``reference(request)`` its outputs (None: not known),
        ``culprit(request)`` whether it is bad."""
        self.reference, self.culprit = reference, culprit

    def check(self) -> list[str]:
        """The runtime's invariants over every request executed so far (see the docstring);
        returns the violations, all of them recorded."""
        for request in self.executed:
            answers = request.answers
            name = request._id or "a request"
            if len(answers) != 1:
                self.violation(f"{name} got {len(answers)} answers")
                continue
            if request.deadline_s is not None and request.sender.answered_at is not None:
                late = (request.sender.answered_at - request.executed_at
                        - request.deadline_s)
                if late > DEADLINE_SLACK:
                    self.violation(f"{name} was answered {late:.3f} s past its deadline")
            response = answers[0]
            bad = self.culprit(request) if self.culprit else None
            if response.has_error():
                if (response.error().code() == TritonError.INVALID_ARG and bad is False):
                    self.violation(f"{name} got another request's INVALID_ARG: "
                                   f"{response.error().message()}")
                continue
            if bad:
                self.violation(f"{name} is bad and succeeded")
            wanted = self.reference(request) if self.reference else None
            if wanted is not None:
                got = {t.name(): t.as_numpy() for t in response.output_tensors}
                if set(got) != set(wanted) or not all(
                        np.array_equal(got[n], v) for n, v in wanted.items()):
                    self.violation(f"{name} did not get exactly its own rows' outputs")
        return self.violations

    def violation(self, what: str) -> None:
        with self.state:
            self.violations.append(what)

    # -- the stub's side ----------------------------------------------------------------------
    def execute(self, model, requests: list[Request], decoupled: bool = False):
        """Call ``model.execute(requests)`` as r24.10's stub does, then release the requests."""
        now = time.monotonic()
        config = getattr(model, "config", None)
        with self.state:
            for request in requests:
                request.fake = request.sender.fake = self
                request.executed_at = now
                if config is not None:
                    timeout = request._timeout / 1e6
                    request.deadline_s = (config.default_deadline_ms / 1e3 if timeout <= 0 else
                                          min(timeout, config.max_deadline_ms / 1e3))
                self.executed.append(request)
                if request._id and request._id not in self.by_id:
                    self.by_id[request._id] = request
                elif request._id:
                    self.by_id[request._id] = None  # not unique: not checked by id
        try:
            returned = model.execute(requests)
        except BaseException as error:  # noqa: BLE001 - r24.10 deletes every factory: a double free
            self.violation(f"execute raised {type(error).__name__}: {error}")
            for request in requests:
                with _SENDER_LOCK:
                    if not request.sender.closed:
                        request.sender.closed = True
                        request.sender.sent.append(InferenceResponse(error=TritonError(
                            f"Failed to process the request(s) for model: {error}")))
                request.sender.done.set()
            returned = None
        if returned is not None and decoupled:
            self.violation("a decoupled model's execute returned responses (r24.10 refuses "
                           "them: pb_stub.cc)")
            returned = None
        if returned is not None:
            self._deliver(requests, returned)
        for request in requests:
            request.release()
        bound = getattr(getattr(model, "config", None), "max_owed_answers", 0)
        with self.state:
            owed = self.owed.setdefault(id(model), [])
            owed[:] = [r for r in owed + list(requests) if r.owed]
            over = len(owed) > bound and not self.faults.raised
        if over:  # (with a fault raised, an answer r24.10 can no longer give stays open here)
            self.violation(f"{len(owed)} answers owed past execute, above the instance's "
                           f"max_owed_answers {bound}: lost if its stub dies")
        return returned

    def _deliver(self, requests: list[Request], returned) -> None:
        """What r24.10 does with the list ``execute`` returned (``pb_stub.cc`` 808-860): one
        final response per request whose sender was never used (``None``: none). The list is
        checked whole before any response goes: one entry per request, each ``None`` or an
        ``InferenceResponse``, and none for a request its sender already answered
        (``UpdateStateAndCounters`` refuses it, 840-856). Any fault fails the whole batch: no
        entry is delivered, and each request not answered yet gets the batch's error
        (709-746)."""
        problem = None
        if not isinstance(returned, list) or len(returned) != len(requests):
            problem = f"execute returned {returned!r}, not one entry per request"
        else:
            for request, response in zip(requests, returned):
                if response is not None and not isinstance(response, InferenceResponse):
                    problem = f"execute returned {response!r} for a request"
                elif response is not None and request.sender.closed:
                    problem = ("execute returned a response for a request its sender answered: "
                               "r24.10 fails the whole batch")
                if problem:
                    break
        if problem is None:
            for request, response in zip(requests, returned):
                if response is not None:
                    request.sender.closed = True
                    request.returned = response
                    request.sender.answered_at = time.monotonic()
                    request.sender.done.set()
            return
        self.violation(problem)
        for request in requests:
            with _SENDER_LOCK:
                if request.sender.closed:
                    continue
                request.sender.closed = True
                request.sender.sent.append(InferenceResponse(error=TritonError(
                    f"Failed to process the request(s) for model, message: {problem}")))
                request.sender.answered_at = time.monotonic()
            request.sender.done.set()

    def finalize(self, model) -> None:
        """``finalize``: from its start ``exec`` raises; after it returns, no pb_utils call may
        happen. It begins once every answer owed past ``execute`` is given (up to OWED_WAIT):
        r24.10's core frees a model only when its response factories are released."""
        with self.state:
            owed = list(self.owed.get(id(model), []))
        for request in owed:
            request.sender.done.wait(OWED_WAIT)
        self.finalizing = True
        model.close()
        self.finalized = True

    # -- what tests read ----------------------------------------------------------------------
    @staticmethod
    def PreferredMemory(kind, device):
        return (kind, device)

    def get_input_tensor_by_name(self, request: Request, name: str):
        request._use("get_input_tensor_by_name")
        return _InputTensor(request, name) if name in request._buffers else None

    def get_output_tensor_by_name(self, response: InferenceResponse, name: str) -> Tensor | None:
        self.enter("get_output_tensor_by_name")
        self.faults.check("get_output_tensor_by_name")
        return next((t for t in response.output_tensors if t.name() == name), None)

    def metric(self, family: str, **labels: str) -> float:
        """Sum of ``family``'s series whose labels include ``labels``."""
        with self.state:
            return sum(value for (name, *found), value in self.metrics.items()
                       if name == family and set(labels.items()) <= set(found))


def _held_by_this_thread(lock) -> bool:
    owned = getattr(lock, "_is_owned", None)  # RLock: whether this thread holds it
    if owned is not None:
        return owned()
    return lock.locked()
