"""BLS probe (tests only; never in model_repository/): one sub-request, and the error it got.

The orchestrators classify a failed sub-request by its message (``bls_models.errors``): in
r24.10 every BLS error arrives with code INTERNAL. This model lets a test see the real message
that a real sub-model, on the real backend, gives a BLS caller. Its one input, SPEC, is JSON::

    {"model": "classifier", "timeout_us": 0,
     "inputs": [{"name": "PIXELS", "dtype": "float32", "shape": [1, 3, 224, 224],
                 "fill": 0.0, "corner": [2.25, -2.04, 2.64]}],
     "outputs": ["LOGITS"]}

(``corner`` sets ``[i, c, 0, 0]`` of every item ``i`` for channel ``c``; ``timeout_us`` is the BLS
request timeout; ``"memory": "cpu"`` asks for the outputs in host memory, else none is named.) It
sends that request with ``exec`` and answers MESSAGE: the sub-response's error message, or the
empty string if it succeeded; and MEMORY: JSON, each output's memory as r24.10 handed it over
("cpu" or "gpu", from ``is_cpu()``: a KIND_GPU sub-model's outputs come in GPU memory unless
host memory is asked for).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _tensor(spec):
    data = np.full(spec["shape"], spec.get("fill", 0), dtype=spec["dtype"])
    for channel, value in enumerate(spec.get("corner", [])):
        data[:, channel, 0, 0] = value
    return pb_utils.Tensor(spec["name"], data)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "SPEC").as_numpy().reshape(-1)[0]
            spec = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
            memory = ({"preferred_memory": pb_utils.PreferredMemory(
                pb_utils.TRITONSERVER_MEMORY_CPU, 0)} if spec.get("memory") == "cpu" else {})
            sub = pb_utils.InferenceRequest(
                model_name=spec["model"], inputs=[_tensor(t) for t in spec["inputs"]],
                requested_output_names=spec.get("outputs", []),
                timeout=int(spec.get("timeout_us", 0)), **memory)
            response = sub.exec()
            message = response.error().message() if response.has_error() else ""
            where = {} if response.has_error() else {
                tensor.name(): "cpu" if tensor.is_cpu() else "gpu"
                for tensor in response.output_tensors()}
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("MESSAGE", np.array([message.encode()], dtype=np.object_)),
                pb_utils.Tensor("MEMORY", np.array([json.dumps(where).encode()],
                                                   dtype=np.object_))]))
        return responses
