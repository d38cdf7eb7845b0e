"""Bad input, over HTTP and gRPC, against both orchestrators: every case gets a clear error with a
client-error status (INVALID_ARG: HTTP 400, gRPC INVALID_ARGUMENT) — from Triton's own checks or
the orchestrator's — and afterwards the server is healthy and a normal request succeeds.

The requests are built by hand (HTTP/JSON and the binary extension with ``requests``, gRPC with
the raw protobuf messages), because the point is to send what a well-behaved client library
would refuse to. The one accepted exception: Triton's HTTP front end answers malformed JSON with
500 before any model sees it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bls_models import spec as S
from tests.helpers import image

IMAGE_DIMS = list(S.IMAGE.dims)      # [224, 224, 3]
TOKEN_DIMS = [S.TAGGER_SEQ_LEN]      # a good document: tag_pipeline takes 1 to max_tokens


@dataclass(frozen=True)
class Model:
    name: str
    input: str
    datatype: str
    dims: list[int]
    max_batch: int
    output: str

    def good(self, batch: int = 1) -> np.ndarray:
        if self.datatype == "UINT8":
            return image(seed=11, batch=batch)
        return np.random.default_rng(11).integers(0, S.TAGGER_VOCAB, (batch, *self.dims))


MODELS = [Model("pipeline", "IMAGE", "UINT8", IMAGE_DIMS, S.PIPELINE.max_batch_size, "CLASS_IDS"),
          Model("tag_pipeline", "TOKENS", "INT64", TOKEN_DIMS, S.TAG_PIPELINE.max_batch_size, "TAGS")]


@dataclass
class Case:
    """One malformed request: ``inputs`` are (name, datatype, shape, raw bytes) tuples."""

    id: str
    inputs: list[tuple[str, str, list[int], bytes]]
    outputs: list[str] = field(default_factory=list)
    expect: tuple[str, ...] = ()       # fragments the error message must contain (lower case)


def raw(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def cases(model: Model) -> list[Case]:
    good = model.good()
    shape = [1, *model.dims]
    other = ("FP32", np.zeros(shape, np.float32)) if model.datatype != "FP32" else (
        "INT32", np.zeros(shape, np.int32))
    too_many = model.good(model.max_batch + 1)
    huge = [1, *[2 ** 20 for _ in model.dims]]  # declares terabytes; a few bytes are sent
    nan = np.full(shape, np.nan, np.float32)
    return [
        Case("wrong-dtype", [(model.input, other[0], shape, raw(other[1]))], expect=("data-type",)),
        Case("nan-as-float", [(model.input, "FP32", shape, raw(nan))], expect=("data-type",)),
        Case("wrong-rank", [(model.input, model.datatype, shape[:-1], raw(good[..., 0]))],
             expect=("shape",)),
        Case("batch-above-max", [(model.input, model.datatype, list(too_many.shape),
                                  raw(too_many))], expect=("batch",)),
        Case("empty-batch", [(model.input, model.datatype, [0, *model.dims], b"")]),
        Case("missing-input", [], expect=("input",)),
        Case("unknown-input", [(model.input, model.datatype, shape, raw(good)),
                               ("NOT_AN_INPUT", "FP32", [1, 1], raw(np.zeros((1, 1), np.float32)))],
             expect=("not_an_input",)),
        Case("unknown-output", [(model.input, model.datatype, shape, raw(good))],
             outputs=["NOT_AN_OUTPUT"], expect=("not_an_output",)),
        Case("enormous-declared-shape", [(model.input, model.datatype, huge, raw(good)[:64])]),
        Case("truncated-payload", [(model.input, model.datatype, shape, raw(good)[:-7])]),
    ] + ([Case("wrong-dims", [(model.input, model.datatype,
                               [1, *model.dims[:-1], model.dims[-1] + 1],
                               raw(np.zeros((1, *model.dims[:-1], model.dims[-1] + 1),
                                            good.dtype)))], expect=("shape",))]
         if model.name != "tag_pipeline" else [
        Case("empty-document", [(model.input, model.datatype, [1, 0], b"")],
             expect=("tokens", "empty")),
        Case("document-over-max-tokens",
             [(model.input, model.datatype, [1, S.MAX_TOKENS + 1],
               raw(np.zeros((1, S.MAX_TOKENS + 1), np.int64)))],
             expect=("tokens", str(S.MAX_TOKENS), "max_tokens"))]
    ) + ([Case("token-out-of-range",
               [(model.input, model.datatype, shape,
                 raw(np.where(np.arange(model.dims[0]) == 5, S.TAGGER_VOCAB, good)))],
               expect=("tokens", str(S.TAGGER_VOCAB)))]
         if model.name == "tag_pipeline" else [])


ALL = [(model, case) for model in MODELS for case in cases(model)]
IDS = [f"{model.name}-{case.id}" for model, case in ALL]


# -- senders --------------------------------------------------------------------------------------
def send_http(server, model: Model, case: Case) -> tuple[int, str]:
    """HTTP with the binary-data extension: a JSON header followed by the raw tensor bytes."""
    header = {"inputs": [{"name": n, "datatype": d, "shape": s,
                          "parameters": {"binary_data_size": len(b)}} for n, d, s, b in case.inputs]}
    if case.outputs:
        header["outputs"] = [{"name": o} for o in case.outputs]
    head = json.dumps(header).encode()
    body = head + b"".join(b for *_, b in case.inputs)
    if case.id == "truncated-payload":
        # The header promises every byte of the tensor; the body stops 7 bytes short.
        declared = len(raw(model.good()))
        head = json.dumps({"inputs": [{"name": model.input, "datatype": model.datatype,
                                       "shape": [1, *model.dims],
                                       "parameters": {"binary_data_size": declared}}]}).encode()
        body = head + case.inputs[0][3]
    reply = requests.post(f"http://{server.http_url}/v2/models/{model.name}/infer", data=body,
                          headers={"Inference-Header-Content-Length": str(len(head)),
                                   "Content-Type": "application/octet-stream"}, timeout=60)
    return reply.status_code, reply.text


def send_grpc(server, model: Model, case: Case) -> tuple[str, str]:
    request = service_pb2.ModelInferRequest(model_name=model.name)
    for name, datatype, shape, data in case.inputs:
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(shape)
        request.raw_input_contents.append(data)
    for name in case.outputs:
        request.outputs.add().name = name
    with grpc.insecure_channel(server.grpc_url) as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        except grpc.RpcError as error:
            return str(error.code()), error.details() or ""
    return "OK", ""


def assert_still_serving(server, model: Model, protocol: str) -> None:
    assert requests.get(f"http://{server.http_url}/v2/health/ready", timeout=10).status_code == 200
    good = model.good()
    case = Case("good", [(model.input, model.datatype, list(good.shape), raw(good))])
    if protocol == "http":
        status, text = send_http(server, model, case)
        assert status == 200, text
    else:
        code, details = send_grpc(server, model, case)
        assert code == "OK", details


# -- the matrix ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, case", ALL, ids=IDS)
def test_bad_http_request_is_a_client_error_and_the_server_carries_on(server, model, case):
    status, text = send_http(server, model, case)
    assert status == 400, f"{case.id}: HTTP {status}: {text}"
    message = json.loads(text).get("error", "").lower()
    assert message and all(f in message for f in case.expect), message
    assert_still_serving(server, model, "http")


@pytest.mark.parametrize("model, case", ALL, ids=IDS)
def test_bad_grpc_request_is_invalid_argument_and_the_server_carries_on(server, model, case):
    code, details = send_grpc(server, model, case)
    assert code == "StatusCode.INVALID_ARGUMENT", f"{case.id}: {code}: {details}"
    assert details and all(f in details.lower() for f in case.expect), details
    assert_still_serving(server, model, "grpc")


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("body", [b"{not json", b'{"inputs": [{"name": 1}]}', b"",
                                  b'{"inputs": [{"name": "X", "datatype": "UINT8", '
                                  b'"shape": [1], "data": "abc"}]}'],
                         ids=["syntax", "wrong-types", "empty", "data-not-a-list"])
def test_malformed_json_is_refused_and_the_server_carries_on(server, model, body):
    reply = requests.post(f"http://{server.http_url}/v2/models/{model.name}/infer", data=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
    # Triton's HTTP front end refuses these itself; for a JSON syntax error it says 500.
    assert reply.status_code in (400, 500), reply.text
    assert json.loads(reply.text).get("error"), reply.text
    assert_still_serving(server, model, "http")
