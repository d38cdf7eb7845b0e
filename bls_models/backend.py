"""The python backend's API (``triton_python_backend_utils``, r24.10): the only module that calls
it, and the place its rules live. Objects that wrap backend memory (requests and their tensors,
``Tensor``, ``InferenceRequest``, ``InferenceResponse``, ``TritonError``) are made, read and
freed under ``lock`` (stubs crashed when threads used them at once); round trips to the server
(``exec``, ``send``, ``is_cancelled``, metric increments) hold no lock; one ``TritonError`` per
response; once ``finalized``, nothing calls pb_utils, not even a destructor.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

_LEFT_AT_SHUTDOWN: list = []  # backend objects got back after finalize: kept until the exit


class Finalized(RuntimeError):
    """The model was finalized while a sub-request was out: its result is dropped."""


class NotSent(RuntimeError):
    """A response not built or not handed to its sender, which was never used."""


class DeviceTensor:
    """A stage output kept where its sub-model left it (``gpu_tensors``: GPU memory), passed
    whole to later stages by DLPack. Taking every row of it (what ``setup.rows`` gives a run whose
    rows all asked) gives it back; a part would need a GPU array library: a ``TypeError``."""

    __slots__ = ("tensor", "rows")

    def __init__(self, tensor, rows: int) -> None:
        self.tensor, self.rows = tensor, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, rows):
        if rows != slice(None) and (isinstance(rows, slice) or list(rows) != [*range(self.rows)]):
            raise TypeError(f"a stage output kept on the GPU is passed on whole: {rows!r} "
                            f"selects part of its {self.rows} rows")
        return self


class Backend:
    def __init__(self, pb_utils, model: str) -> None:
        self.pb, self.model = pb_utils, model
        self.lock = threading.RLock()  # logging takes it too, also from code that holds it
        self.finalized = threading.Event()
        self._cpu = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
        self.keep_host = False  # keep outputs in host memory by DLPack too (gpu_tensors "always")

    @staticmethod
    def owns_memory(array: np.ndarray) -> bool:
        """Whether numpy allocated ``array``'s memory (for it or an array it views), rather than
        borrowing a foreign buffer such as shared memory (r24.10 hands out copies:
        docs/orchestrator.md, "Lifetime")."""
        while isinstance(array, np.ndarray) and not array.flags.owndata:
            array = array.base
        return isinstance(array, np.ndarray)

    @staticmethod
    def own(array: np.ndarray) -> np.ndarray:  # a copy unless numpy owns its memory
        return array if Backend.owns_memory(array) else np.array(array, copy=True)

    # -- requests (execute's thread, while the request is alive) ----------------------------
    def read(self, request, input_names):
        """(id, timeout µs, {name: own array} or a missing input's name, requested outputs)."""
        pb = self.pb
        with self.lock:
            request_id = request.request_id()
            timeout_us = int(request.timeout())
            inputs = {}
            for name in input_names:
                tensor = pb.get_input_tensor_by_name(request, name)
                if tensor is None:
                    return request_id, timeout_us, name, []
                inputs[name] = self.own(tensor.as_numpy())
                tensor = None
            return request_id, timeout_us, inputs, list(request.requested_output_names())

    def is_cancelled(self, request) -> bool:
        return bool(request.is_cancelled())  # a round trip; no lock

    # -- answers ----------------------------------------------------------------------------
    def response(self, arrays: list[tuple[str, np.ndarray]] | None = None,
                 message: str = "", code: str = ""):
        """An ``InferenceResponse`` with ``arrays``, or the error ``message`` with ``code``."""
        pb = self.pb
        with self.lock:
            if arrays is None:  # one TritonError per response
                return pb.InferenceResponse(error=pb.TritonError(message,
                                                                 getattr(pb.TritonError, code)))
            return pb.InferenceResponse(
                output_tensors=[pb.Tensor(name, array) for name, array in arrays])

    def sender(self, request):
        with self.lock:
            return request.get_response_sender()

    def send(self, request, arrays=None, message: str = "", code: str = "", sender=None) -> None:
        """A response (as ``response`` builds it) through ``request``'s sender (or ``sender``),
        final. Raises ``NotSent`` if it failed before the sender was used; a ``send`` that
        raises has closed the sender (r24.10): no retry."""
        response = None
        try:
            try:
                response = self.response(arrays, message, code)
                sender = sender or self.sender(request)
            except Exception as error:  # noqa: BLE001 - reported as what it means to the caller
                raise NotSent(repr(error)) from None
            sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                if self.finalized.is_set():
                    _LEFT_AT_SHUTDOWN.append((response, sender))
                response = sender = None

    # -- sub-requests (any thread) ----------------------------------------------------------
    def infer(self, model: str, inputs: dict, outputs: list[str], request_id: str, gate,
              keep: frozenset = frozenset(), reduce=None):
        """One sub-request: ``(outputs, None)`` or ``(None, its error message)``. ``gate()``,
        called under the lock as the request is made, returns its timeout (µs) or raises to
        send nothing. Outputs are the stub's own arrays (or ``reduce`` of them, while the
        response lives); one named in ``keep`` that arrives on a GPU (or anywhere, with
        ``keep_host``) stays a ``DeviceTensor``."""
        pb = self.pb
        request = response = tensor = None
        devices: dict = {}
        tensors: list = []
        try:
            with self.lock:
                timeout_us = gate()
                memory = {} if keep else {"preferred_memory": self._cpu}
                for name, value in inputs.items():
                    tensors.append(pb.Tensor.from_dlpack(name, value.tensor.to_dlpack())
                                   if isinstance(value, DeviceTensor) else pb.Tensor(name, value))
                request = pb.InferenceRequest(
                    model_name=model, requested_output_names=outputs, request_id=request_id,
                    timeout=timeout_us, inputs=tensors, **memory)
            response = request.exec()  # blocks (GIL released) until the sub-model answers
            views = {}
            with self.lock:
                if self.finalized.is_set():
                    raise Finalized(model)
                if response.has_error():
                    return None, response.error().message()
                for name in outputs:
                    tensor = pb.get_output_tensor_by_name(response, name)
                    if tensor is None:
                        return None, f"the response has no output '{name}'"
                    if name in keep and (self.keep_host or not tensor.is_cpu()):
                        devices[name] = DeviceTensor(
                            pb.Tensor.from_dlpack(name, tensor.to_dlpack()),
                            len(next(iter(inputs.values()))) if inputs else 1)
                    else:
                        views[name] = tensor.as_numpy()  # CPU memory: the fallback for keep
                tensor = None
            # numpy only, while the response (which keeps any borrowed memory) is alive
            result = reduce(views) if reduce is not None else {n: self.own(v)
                                                               for n, v in views.items()}
            del views
            return {**result, **devices}, None
        finally:
            with self.lock:  # backend objects die under the lock (kept ones are returned)
                if self.finalized.is_set():
                    _LEFT_AT_SHUTDOWN.append((request, response, tensor, devices, tensors[:]))
                tensors.clear()  # a traceback may hold the list
                request = response = tensor = devices = None

    # -- metrics and the log ------------------------------------------------------------------
    def metric_family(self, name: str, description: str, kind: str):
        with self.lock:
            return self.pb.MetricFamily(name=name, description=description,
                                        kind=getattr(self.pb.MetricFamily, kind))

    def metric(self, family, labels: dict[str, str]):
        return family.Metric(labels=labels)  # a round trip: it registers with the server

    def increment(self, metric, value: float) -> None:
        if not self.finalized.is_set():
            metric.increment(value)  # a round trip; no lock

    def clear(self, *collections) -> None:
        """Empty containers of backend objects, in order, under the lock; a ``DeviceTensor``'s
        memory goes now, whoever else still holds the (then empty) object."""
        with self.lock:
            for collection in collections:
                if self.finalized.is_set():
                    _LEFT_AT_SHUTDOWN.append(collection.copy())
                else:
                    for item in collection:
                        if isinstance(item, DeviceTensor):
                            item.tensor = None
                collection.clear()

    def log(self, message: str, error: bool = False) -> None:
        """Log through Triton (nothing once finalized). Never raises."""
        try:
            with self.lock:
                if not self.finalized.is_set():
                    logger = self.pb.Logger
                    (logger.log_error if error else logger.log_info)(f"[{self.model}] {message}")
        except Exception:  # noqa: BLE001 - the stub's stderr is the last resort
            try:
                print(f"[{self.model}] {message}", file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - logging must never fail its caller
                pass

    def finalize(self) -> None:
        with self.lock:
            self.finalized.set()
