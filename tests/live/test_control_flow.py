"""What an ensemble does and `pipeline` now does too, and what only BLS can do, against a live
server over HTTP and gRPC:

* requested outputs decide the stages: a request that asks only for the classes sends no
  embedder sub-request, one that asks only for EMBEDDING no classifier one, counted by Triton's
  own statistics per model; a batch mixing subsets sends each stage exactly the rows that asked;
* long documents in ``tag_pipeline`` (a loop): any length from 1 to ``max_tokens``, cut into
  512-token windows and stitched back, equal to the same windows stitched in-process with ONNX
  Runtime; 512 tokens answer exactly what the tagger answers.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bls_models import pipelines
from bls_models import spec as S
from tests.helpers import SOFTMAX_RTOL, expected_pipeline, images, infer, inference_count, request_inputs

CLASSES = ("CLASS_IDS", "CLASS_PROBS")
SUBSETS = {"classes": CLASSES, "embedding": ("EMBEDDING",), "all": ()}
STAGES = ("preprocess", "classifier", "embedder")


def counts(client, models=STAGES) -> dict[str, int]:
    """Rows each stage model has computed (Triton's statistics; a gRPC client)."""
    return {model: inference_count(client, model) for model in models}


def rows_sent(before: dict, after: dict) -> dict[str, int]:
    return {model: after[model] - before[model] for model in before}


def wait_all(pending: list[list], timeout: float = 60.0) -> None:
    """Until every list of ``pending`` holds its callback's (result, error)."""
    deadline = time.monotonic() + timeout
    while not all(pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(pending), f"{sum(not p for p in pending)} of {len(pending)} got no answer"


def check_outputs(result, expected: dict, asked) -> None:
    for name in asked or ("CLASS_IDS", "CLASS_PROBS", "EMBEDDING"):
        value = result.as_numpy(name)
        assert value is not None, f"no {name}"
        if name == "CLASS_IDS":
            np.testing.assert_array_equal(value, expected[name])
        else:
            np.testing.assert_allclose(value, expected[name], rtol=SOFTMAX_RTOL, atol=1e-6)
    for name in set(("CLASS_IDS", "CLASS_PROBS", "EMBEDDING")) - set(asked or ()):
        if asked:
            assert result.as_numpy(name) is None, f"{name} was not asked for"


# -- requested outputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("subset", list(SUBSETS))
@pytest.mark.parametrize("model", ["pipeline", "pipeline_ensemble"])
def test_requested_outputs_decide_the_stages(model, subset, protocol, client_for, grpc_client,
                                             onnx):
    """Each stage's Triton statistics grow by exactly the rows that needed it; the answers equal
    in-process ONNX Runtime for the outputs asked for."""
    client = client_for(protocol)
    image = images(3, seed=40 + len(subset))
    asked = SUBSETS[subset]
    before = counts(grpc_client)
    result = infer(protocol, client, model, "IMAGE", image, "UINT8", asked)
    sent = rows_sent(before, counts(grpc_client))
    check_outputs(result, expected_pipeline(onnx, image), asked)
    assert sent == {"preprocess": 3, "classifier": 0 if subset == "embedding" else 3,
                    "embedder": 0 if subset == "classes" else 3}, sent


def test_a_batch_mixing_subsets_sends_each_stage_the_rows_that_asked(grpc_client, onnx):
    """Requests asking for different outputs, sent at once (so batched together by Triton's
    scheduler where they meet): each is answered what it asked for, and each stage gets exactly
    the rows that needed it, however they were grouped."""
    plan = [(images(1 + i % 2, seed=60 + i), list(SUBSETS)[i % 3]) for i in range(12)]
    before = counts(grpc_client)
    pending = []
    for image, subset in plan:
        wanted = [grpcclient.InferRequestedOutput(name) for name in SUBSETS[subset]]
        results: list = []
        grpc_client.async_infer("pipeline", request_inputs(grpcclient, "IMAGE", image, "UINT8"),
                                lambda result, error, into=results: into.append((result, error)),
                                outputs=wanted or None)
        pending.append(results)
    wait_all(pending)
    sent = rows_sent(before, counts(grpc_client))
    for (image, subset), results in zip(plan, pending):
        result, error = results[0]
        assert error is None, error
        check_outputs(result, expected_pipeline(onnx, image), SUBSETS[subset])
    rows = {subset: sum(len(image) for image, s in plan if s == subset) for subset in SUBSETS}
    assert sent == {"preprocess": sum(rows.values()),
                    "classifier": rows["classes"] + rows["all"],
                    "embedder": rows["embedding"] + rows["all"]}, sent


# -- long documents ---------------------------------------------------------------------------------
def document(length: int, seed: int, count: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, S.TAGGER_VOCAB, (count, length),
                                                dtype=np.int64)


def windowed(onnx, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference: the same windows through ``tagger_tags`` in-process, one at a time, each
    token taken from the window whose centre is nearest."""
    count, length = tokens.shape
    window = S.TAGGER_SEQ_LEN
    starts, ends = pipelines.windows(length, window, S.WINDOW_OVERLAP)
    tags = np.empty((count, length), np.int64)
    probs = np.empty((count, length), np.float32)
    begin = 0
    for start, end in zip(starts, ends):
        piece = np.zeros((count, window), np.int64)
        part = tokens[:, start:start + window]
        piece[:, :part.shape[1]] = part
        got_tags, got_probs = onnx("tagger_tags", TOKENS=piece)
        tags[:, begin:end] = got_tags[:, begin - start:end - start]
        probs[:, begin:end] = got_probs[:, begin - start:end - start]
        begin = end
    return tags, probs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("length", [1, 511, 512, 513, 1000, S.MAX_TOKENS])
def test_a_document_of_any_length_is_tagged_token_by_token(length, protocol, client_for, onnx):
    tokens = document(length, seed=length, count=2)
    result = infer(protocol, client_for(protocol), "tag_pipeline", "TOKENS", tokens, "INT64",
                   ["TAGS", "TAG_PROBS"])
    tags, probs = windowed(onnx, tokens)
    assert result.as_numpy("TAGS").shape == (2, length)
    np.testing.assert_array_equal(result.as_numpy("TAGS"), tags)
    np.testing.assert_allclose(result.as_numpy("TAG_PROBS"), probs, rtol=SOFTMAX_RTOL)


def test_a_document_of_512_tokens_gets_what_the_tagger_answers_bit_for_bit(grpc_client):
    tokens = document(S.TAGGER_SEQ_LEN, seed=3)
    served = infer("grpc", grpc_client, "tag_pipeline", "TOKENS", tokens, "INT64",
                   ["TAGS", "TAG_PROBS"])
    direct = infer("grpc", grpc_client, "tagger_tags", "TOKENS", tokens, "INT64",
                   ["TAGS", "TAG_PROBS"])
    for name in ("TAGS", "TAG_PROBS"):
        assert served.as_numpy(name).tobytes() == direct.as_numpy(name).tobytes(), name


def test_windows_over_the_logits_tagger_are_reduced_and_stitched(grpc_client, onnx):
    tokens = document(1000, seed=5)
    result = infer("grpc", grpc_client, "tag_pipeline_logits", "TOKENS", tokens, "INT64",
                   ["TAGS", "TAG_PROBS"])
    tags, probs = windowed(onnx, tokens)
    np.testing.assert_array_equal(result.as_numpy("TAGS"), tags)
    np.testing.assert_allclose(result.as_numpy("TAG_PROBS"), probs, rtol=SOFTMAX_RTOL)


def test_documents_of_mixed_lengths_sent_at_once_each_get_their_own_tags(grpc_client, onnx):
    """Documents of one length share a group and their windows one sub-request; lengths differ
    between groups, whose sub-requests (all 512-token windows) go out at once."""
    lengths = [1, 600, 512, 1000, 600, 2048, 37, 1000]
    documents = [document(length, seed=100 + i) for i, length in enumerate(lengths)]
    pending = []
    for tokens in documents:
        results: list = []
        grpc_client.async_infer("tag_pipeline",
                                request_inputs(grpcclient, "TOKENS", tokens, "INT64"),
                                lambda result, error, into=results: into.append((result, error)))
        pending.append(results)
    wait_all(pending)
    for tokens, results in zip(documents, pending):
        assert results, f"no answer for a document of {tokens.shape[1]} tokens"
        result, error = results[0]
        assert error is None, error
        tags, probs = windowed(onnx, tokens)
        np.testing.assert_array_equal(result.as_numpy("TAGS"), tags)
        np.testing.assert_allclose(result.as_numpy("TAG_PROBS"), probs, rtol=SOFTMAX_RTOL)
