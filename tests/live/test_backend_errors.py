"""How Triton's C++ onnxruntime backend fails, as a BLS caller and a client see it.

* ``errors.classify_sub_error`` turns a sub-request's error message into a kind (r24.10 delivers
  every BLS error with code INTERNAL). Each case here makes a real sub-model on the real backend
  fail one way, through a real BLS sub-request (the ``bls_probe`` model), and checks the kind of
  the message that came back: a refused shape or dtype, a value ONNX Runtime rejects, a model
  that is not ready, a full queue, a queue timeout.
* The backend runs each dynamic batch as one ONNX Runtime call: one request whose values make
  ONNX Runtime fail fails every request batched with it, directly and through ``pipeline``.
  (Isolating the culprit in the orchestrators is a later change; this pins down what happens.)
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from bls_models.errors import Code, Kind, classify_sub_error, sub_request_failed
from modelgen import poison, variants
from tests.helpers import STATUS, image

PROTOCOLS = ("http", "grpc")
PIXELS_SHAPE = [1, *S.PIXELS.dims]
POISON_CORNER = [(v / 255.0 - m) / s for v, m, s in
                 zip(poison.POISON_RGB, S.IMAGENET_MEAN, S.IMAGENET_STD)]


def _client(server, protocol: str):
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    return grpcclient.InferenceServerClient(server.grpc_url)


def probe(server, protocol: str, model: str, inputs: list[dict], timeout_us: int = 0) -> str:
    """The error message of one BLS sub-request (empty if it succeeded), via ``bls_probe``."""
    module = httpclient if protocol == "http" else grpcclient
    spec = {"model": model, "inputs": inputs, "outputs": [], "timeout_us": timeout_us}
    tensor = module.InferInput("SPEC", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps(spec).encode()], dtype=np.object_))
    client = _client(server, protocol)
    try:
        answer = client.infer(variants.PROBE.name, [tensor]).as_numpy("MESSAGE")[0]
    finally:
        client.close()
    return answer.decode() if isinstance(answer, bytes) else str(answer)


def pixels(dtype: str = "float32", shape=None, corner=None) -> dict:
    tensor = {"name": "PIXELS", "dtype": dtype, "shape": shape or PIXELS_SHAPE, "fill": 0.1}
    if corner:
        tensor["corner"] = corner
    return tensor


CASES = {
    # Triton core refuses these before the backend sees them.
    "shape": ("classifier", [pixels(shape=[1, 3, 100, 100])], Kind.INVALID),
    "dtype": ("classifier", [pixels(dtype="float64")], Kind.INVALID),
    "missing input": ("classifier", [], Kind.INVALID),
    # ONNX Runtime rejects the values (a Gather index out of bounds): INVALID_ARGUMENT.
    "value": (variants.FAULT_BATCH.name, [pixels(corner=POISON_CORNER)], Kind.INVALID),
    "not ready": ("no_such_model", [pixels()], Kind.NOT_READY),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_sub_model_error_on_the_real_backend_is_classified(server, protocol, case):
    model, inputs, kind = CASES[case]
    message = probe(server, protocol, model, inputs)
    assert message, f"the sub-request to {model} succeeded; expected a {kind.value} error"
    assert classify_sub_error(message) is kind, message
    error = sub_request_failed("classifier", model, message)
    assert error.code is {Kind.INVALID: Code.INVALID_ARG, Kind.NOT_READY: Code.UNAVAILABLE}[kind]


def _keep_busy(server, model: str, clients: int, stop: threading.Event) -> list[threading.Thread]:
    """``clients`` threads each sending full batches of 16 to ``model`` until ``stop``."""
    data = np.random.default_rng(0).standard_normal((16, *S.PIXELS.dims)).astype(np.float32)

    def loop():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        tensor = grpcclient.InferInput("PIXELS", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        try:
            while not stop.is_set():
                try:
                    client.infer(model, [tensor])
                except InferenceServerException:
                    time.sleep(0.001)  # refused: the queue is full, which is the point
        finally:
            client.close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model, timeout_us, kind", [
    ("classifier_queue1", 0, Kind.QUEUE_FULL),          # one instance, a queue of 1
    ("classifier_queue64", 1000, Kind.DEADLINE),        # waits longer than 1 ms in the queue
])
def test_a_busy_sub_model_refuses_or_expires_and_is_classified(server, protocol, model,
                                                                timeout_us, kind):
    stop = threading.Event()
    threads = _keep_busy(server, model, 4, stop)
    seen = []
    try:
        time.sleep(0.5)
        for _ in range(40):  # the load makes it likely, not certain, on any one attempt
            message = probe(server, protocol, model, [pixels()], timeout_us=timeout_us)
            seen.append(message)
            if message:
                break
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    failed = [m for m in seen if m]
    assert failed, f"no sub-request to the busy {model} failed in {len(seen)} attempts"
    assert classify_sub_error(failed[0]) is kind, failed[0]


# -- one bad request in a dynamic batch --------------------------------------------------------------
def _send_together(server, protocol: str, model: str, name: str, datas: list[np.ndarray],
                   dtype: str) -> list[object]:
    """Send one request per array at once (one thread each); results or exceptions, in order."""
    module = httpclient if protocol == "http" else grpcclient
    outcomes: list[object] = [None] * len(datas)
    barrier = threading.Barrier(len(datas))

    def send(index: int) -> None:
        client = _client(server, protocol)
        tensor = module.InferInput(name, list(datas[index].shape), dtype)
        tensor.set_data_from_numpy(datas[index])
        try:
            barrier.wait(10)
            outcomes[index] = client.infer(model, [tensor])
        except InferenceServerException as error:
            outcomes[index] = error
        finally:
            client.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(datas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outcomes


def _with_company(send, poisoned: int, attempts: int = 3) -> list[object]:
    """``send()`` until the poisoned request shared its batch with at least one other: failed
    statistics carry no batch sizes, so the innocent requests that failed are the evidence. The
    200 ms batching window almost always holds all of them; a very busy host may split them."""
    for _ in range(attempts):
        outcomes = send()
        failed = [i for i, o in enumerate(outcomes) if isinstance(o, InferenceServerException)]
        if poisoned in failed and len(failed) > 1:
            return outcomes
    pytest.fail(f"the poisoned request never shared a batch in {attempts} attempts: {outcomes}")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_one_poisoned_request_fails_its_whole_onnxruntime_batch(server, protocol):
    rng = np.random.default_rng(11)
    clean = [rng.standard_normal((1, *S.PIXELS.dims)).astype(np.float32) for _ in range(4)]
    datas = [*clean[:2], poison.poison_pixels(clean[2]), clean[3]]
    outcomes = _with_company(lambda: _send_together(
        server, protocol, variants.FAULT_BATCH.name, "PIXELS", datas, "FP32"), poisoned=2)
    # Every request batched with the bad one fails with ONNX Runtime's error for that one item,
    # as INTERNAL (the backend's code for any ONNX Runtime failure); one that ran in another
    # batch (if the host split them) succeeded.
    failed = [o for o in outcomes if isinstance(o, InferenceServerException)]
    assert {o.status() for o in failed} == {STATUS[protocol]["INTERNAL"]}
    assert all("out of data bounds" in o.message() for o in failed)
    # Alone, the innocent ones succeed, with exactly the model's result.
    for data in clean:
        result = _send_together(server, protocol, variants.FAULT_BATCH.name, "PIXELS", [data],
                                "FP32")[0]
        np.testing.assert_allclose(result.as_numpy("LOGITS"), poison.reference(data),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_through_pipeline_only_the_poisoned_request_fails(server, protocol):
    """``pipeline_poison`` is the committed pipeline with the poisonable model as its classifier
    stage. A failed group is isolated: its members run again one at a time, so the poisoned
    request alone gets the error, blamed as invalid input, and its batch-mates their results."""
    images = [image(seed) for seed in (21, 22, 23, 24)]
    images[1] = poison.poison_image(images[1])
    outcomes = _send_together(server, protocol, "pipeline_poison", "IMAGE", images, "UINT8")
    bad = outcomes[1]
    assert isinstance(bad, InferenceServerException), bad
    assert bad.status() == STATUS[protocol]["INVALID_ARG"]
    assert "stage 'classifier'" in bad.message() and "out of data bounds" in bad.message()
    innocent = [outcomes[i] for i in (0, 2, 3)]
    assert not [o for o in innocent if isinstance(o, InferenceServerException)], innocent
    for o in innocent:
        assert o.as_numpy("CLASS_IDS").shape == (1, S.TOP_K)
