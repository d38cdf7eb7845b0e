"""The BLS pipelines compute what ONNX Runtime computes on the same files, over HTTP and gRPC,
and the ensemble gives the same answers as the BLS pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient

from bls_models import pipelines
from bls_models import spec as S
from tests.helpers import SOFTMAX_RTOL, assert_served, batch_spread, expected_pipeline, images, infer


def tokens(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, S.TAGGER_VOCAB, (count, S.TAGGER_SEQ_LEN), dtype=np.int64)


IMAGE_OUTPUTS = ("CLASS_IDS", "CLASS_PROBS", "EMBEDDING")


def image_spreads(onnx, image) -> dict[str, float]:
    """Per output, ``batch_spread`` of ``image`` in a full ``pipeline`` batch."""
    return dict(zip(IMAGE_OUTPUTS, batch_spread(
        lambda d: [expected_pipeline(onnx, d)[n] for n in IMAGE_OUTPUTS], image,
        S.PIPELINE.max_batch_size)))


def check_image_result(result, onnx, image, softmax_in_onnx: bool = False, spreads=None):
    """``result`` against the pipeline computed in-process on the same files: equal up to
    ``batch_spread`` (zero here; ``spreads``, else measured on ``image``). The ensemble's
    softmax runs in ONNX Runtime (postprocess), the orchestrator's in numpy: CLASS_PROBS then
    agree within SOFTMAX_RTOL."""
    expected = expected_pipeline(onnx, image)
    spreads = spreads or image_spreads(onnx, image)
    np.testing.assert_array_equal(result.as_numpy("CLASS_IDS"), expected["CLASS_IDS"])
    if softmax_in_onnx:
        np.testing.assert_allclose(result.as_numpy("CLASS_PROBS"), expected["CLASS_PROBS"],
                                   rtol=SOFTMAX_RTOL)
    else:
        assert_served(result.as_numpy("CLASS_PROBS"), expected["CLASS_PROBS"],
                      spreads["CLASS_PROBS"], "CLASS_PROBS")
    assert_served(result.as_numpy("EMBEDDING"), expected["EMBEDDING"], spreads["EMBEDDING"],
                  "EMBEDDING")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
# pipeline_gpu_tensors: PIXELS kept by DLPack between stages (gpu_tensors "always": in host
# memory on this CPU-only server, in GPU memory in the container on a GPU).
@pytest.mark.parametrize("model", ["pipeline", "pipeline_ensemble", "pipeline_gpu_tensors"])
def test_image_pipeline_matches_onnxruntime(model, protocol, client_for, onnx):
    image = images(3, seed=11)
    result = infer(protocol, client_for(protocol), model, "IMAGE", image, "UINT8",
                   ["CLASS_IDS", "CLASS_PROBS", "EMBEDDING"])
    assert result.as_numpy("CLASS_IDS").dtype == np.int64
    assert result.as_numpy("CLASS_PROBS").dtype == np.float32
    assert result.as_numpy("EMBEDDING").shape == (3, S.EMBEDDING_DIM)
    check_image_result(result, onnx, image, softmax_in_onnx=model == "pipeline_ensemble")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_kept_tensor_goes_by_dlpack_from_one_sub_request_to_the_next(server, protocol,
                                                                       client_for, onnx):
    """The GPU profiles' path, end to end through tritonserver 2.51 on this CPU server:
    ``pipeline_gpu_tensors`` (``gpu_tensors: "always"``) keeps preprocess's PIXELS as it comes
    (``to_dlpack`` out of the sub-response), and the classifier's and the embedder's
    sub-requests take it by ``Tensor.from_dlpack``. A batch asking for every output goes that
    way; one asking only for EMBEDDING selects rows, so its PIXELS come in host memory. Both
    match ONNX Runtime in-process."""
    log = getattr(server, "log_file", None)
    if log is not None:  # the orchestrator says what it keeps when it loads
        loaded = [line for line in log.read_text().splitlines()
                  if "[pipeline_gpu_tensors] orchestrating" in line]
        assert loaded and all("kept by DLPack: {'preprocess': frozenset({'PIXELS'})}" in line
                              for line in loaded), loaded
    image = images(4, seed=31 + (protocol == "grpc"))
    result = infer(protocol, client_for(protocol), "pipeline_gpu_tensors", "IMAGE", image,
                   "UINT8", list(IMAGE_OUTPUTS))
    check_image_result(result, onnx, image)
    some = infer(protocol, client_for(protocol), "pipeline_gpu_tensors", "IMAGE", image[:1],
                 "UINT8", ["EMBEDDING"])
    assert some.as_numpy("CLASS_IDS") is None
    np.testing.assert_array_equal(some.as_numpy("EMBEDDING"),
                                  expected_pipeline(onnx, image[:1])["EMBEDDING"])


def test_bls_and_ensemble_give_the_same_answers(grpc_client):
    image = images(4, seed=21)
    names = ["CLASS_IDS", "CLASS_PROBS", "EMBEDDING"]
    bls = infer("grpc", grpc_client, "pipeline", "IMAGE", image, "UINT8", names)
    ensemble = infer("grpc", grpc_client, "pipeline_ensemble", "IMAGE", image, "UINT8", names)
    np.testing.assert_array_equal(bls.as_numpy("CLASS_IDS"), ensemble.as_numpy("CLASS_IDS"))
    # The same embedder, the same file: the same bits. The softmax: numpy against ONNX Runtime.
    np.testing.assert_array_equal(bls.as_numpy("EMBEDDING"), ensemble.as_numpy("EMBEDDING"))
    np.testing.assert_allclose(bls.as_numpy("CLASS_PROBS"), ensemble.as_numpy("CLASS_PROBS"),
                               rtol=SOFTMAX_RTOL)
    assert len({tuple(row) for row in bls.as_numpy("CLASS_IDS")}) == 4, "answers depend on the image"


def test_only_requested_outputs_are_returned(grpc_client, onnx):
    image = images(1, seed=5)
    result = infer("grpc", grpc_client, "pipeline", "IMAGE", image, "UINT8", ["EMBEDDING"])
    assert result.as_numpy("CLASS_IDS") is None
    np.testing.assert_array_equal(result.as_numpy("EMBEDDING"),
                                  expected_pipeline(onnx, image)["EMBEDDING"])


@pytest.mark.parametrize("model", ["tag_pipeline", "tag_pipeline_logits"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tag_pipeline_reduces_tagger_logits_on_the_server(protocol, model, client_for, onnx):
    """The committed tag_pipeline (tagger_tags: reduced in the graph) and its variant over the
    logits tagger (reduced in the orchestrator) both answer what the logits reduce to."""
    data = tokens(2, seed=protocol == "http")
    result = infer(protocol, client_for(protocol), model, "TOKENS", data, "INT64",
                   ["TAGS", "TAG_PROBS"])
    (logits,) = onnx("tagger", TOKENS=data)
    tags, probs = pipelines.reduce_tags(logits)
    assert result.as_numpy("TAGS").shape == (2, S.TAGGER_SEQ_LEN)
    np.testing.assert_array_equal(result.as_numpy("TAGS"), tags)
    # tagger_tags reduces in ONNX Runtime; over the logits tagger the orchestrator reduces with
    # the same numpy as here.
    if model == "tag_pipeline":
        np.testing.assert_allclose(result.as_numpy("TAG_PROBS"), probs, rtol=SOFTMAX_RTOL)
    else:
        np.testing.assert_array_equal(result.as_numpy("TAG_PROBS"), probs)


def test_concurrent_pipeline_requests_each_get_their_own_answer(http_client, onnx):
    batches = [images(1 + i % 3, seed=300 + i) for i in range(20)]
    pending = []
    for image in batches:
        tensor = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
        tensor.set_data_from_numpy(image)
        pending.append(http_client.async_infer("pipeline", [tensor]))
    # The spread measured once, on a batch of three: in-process batches of 16 per request
    # cost seconds each on this CPU and measure the same thing.
    spreads = image_spreads(onnx, batches[2])
    for image, request in zip(batches, pending):
        check_image_result(request.get_result(), onnx, image, spreads=spreads)


def test_gpu_checks_runtime_step_rehearsed_on_this_cpu_server(server, repository):
    """`make gpu-check`'s runtime step (ops/gpu_check.py), run here: on this CPU server every
    check holds but the one only a GPU passes, PIXELS in GPU memory when no memory is named."""
    import tritonclient.grpc as grpcclient

    from ops.gpu_check import Check

    client = grpcclient.InferenceServerClient(server.grpc_url)
    check = Check.__new__(Check)
    check._cpu, check.source = None, repository
    try:
        assert Check._memory_and_errors(client) == [
            "preprocess's PIXELS with memory 'unnamed': {'PIXELS': 'cpu'}, expected gpu"]
        assert check._mixed_outputs(client) == []
        assert Check._non_finite(client) == []
    finally:
        client.close()
