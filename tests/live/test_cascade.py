"""``digits_cascade`` on a real server: its answers are the cascade computed in-process by ONNX
Runtime on the same files, row for row over the reporting split; only the rows ``digits_small``
is unsure of reach ``digits_large``, as Triton's own ``nv_inference_count`` counts them; the
threshold's two ends (variants ``digits_cascade_never``, ``digits_cascade_always``); the
committed threshold is the one the validation split chooses; a request with NaN, Inf or a wrong
shape fails alone, INVALID_ARG, before any sub-request; and the ensemble baseline answers both
models' probabilities."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bls_models import spec as S
from modelgen import digits
from tests.helpers import STATUS, assert_served, batch_spread, eventually, settled

BATCH = 16
THRESHOLD = float(S.CASCADE_THRESHOLD.default)  # as committed in digits_cascade's config
CASCADE_OUTPUTS = (S.DIGIT.name, S.DIGIT_PROB.name, S.ESCALATED.name)


@pytest.fixture(scope="module")
def models(repository):
    return digits.sessions(repository)


@pytest.fixture(scope="module")
def held_out():
    _, x_test, _, y_test = digits.split()
    return x_test, y_test


@pytest.fixture(scope="module")
def spread(models, held_out):
    """How much in-process ONNX Runtime itself moves a probability between batch compositions
    (support.batch_spread): what a served probability may differ by."""
    pixels = held_out[0][:BATCH]
    return max(batch_spread(lambda x, name=name: [digits.probabilities(models[name], x)], pixels,
                            S.DIGITS_LARGE.max_batch_size)[0]
               for name in digits.MODELS)


def infer(client, protocol: str, model: str, pixels: np.ndarray, outputs) -> dict:
    module = httpclient if protocol == "http" else grpcclient
    tensor = module.InferInput(S.DIGIT_PIXELS.name, list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels)
    result = client.infer(model, [tensor],
                          outputs=[module.InferRequestedOutput(name) for name in outputs])
    return {name: result.as_numpy(name) for name in outputs}


def client_for(protocol, http_client, grpc_client):
    return http_client if protocol == "http" else grpc_client


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_answers_are_the_in_process_cascade_row_for_row(protocol, http_client, grpc_client,
                                                        models, held_out, spread):
    x_test, y_test = held_out
    client = client_for(protocol, http_client, grpc_client)
    answered = {name: [] for name in CASCADE_OUTPUTS}
    for start in range(0, len(x_test), BATCH):
        pixels = x_test[start:start + BATCH]
        out = infer(client, protocol, "digits_cascade", pixels, CASCADE_OUTPUTS)
        digit, prob, escalated = digits.in_process_cascade(models, pixels, THRESHOLD)
        np.testing.assert_array_equal(out[S.ESCALATED.name], escalated[:, None])
        np.testing.assert_array_equal(out[S.DIGIT.name], digit[:, None])
        assert_served(out[S.DIGIT_PROB.name], prob[:, None], spread, S.DIGIT_PROB.name)
        for name in CASCADE_OUTPUTS:
            answered[name].append(out[name])
    assert answered[S.DIGIT.name][0].dtype == np.int64
    assert answered[S.ESCALATED.name][0].dtype == np.bool_
    digit = np.concatenate(answered[S.DIGIT.name])[:, 0]
    escalated = np.concatenate(answered[S.ESCALATED.name])[:, 0]
    # The reporting split's answers are a cascade's: some rows escalated, most not, and the
    # result is as good as the large model alone (the exact figures: python -m modelgen.digits).
    assert 0 < escalated.mean() <= 0.15
    large = digits.probabilities(models[S.DIGITS_LARGE.name], x_test).argmax(axis=1)
    assert (digit == y_test).mean() >= (large == y_test).mean() - 0.003


def test_the_committed_threshold_is_the_one_the_validation_split_chooses(models):
    """What ships is what the rule picks on these very files (docs/cascade.md)."""
    assert digits.choose_threshold(models) == THRESHOLD


def send_together(server, protocol: str, batches: list[np.ndarray]) -> list:
    """Each of ``batches`` to digits_cascade at once, one client each: its outputs, or the
    error it got."""
    url = server.http_url if protocol == "http" else server.grpc_url
    module = httpclient if protocol == "http" else grpcclient

    def send(pixels):
        try:
            return infer(module.InferenceServerClient(url), protocol, "digits_cascade", pixels,
                         CASCADE_OUTPUTS)
        except InferenceServerException as error:
            return error

    with ThreadPoolExecutor(len(batches)) as pool:
        return list(pool.map(send, batches))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_fail_alone_before_any_sub_request(protocol, server, models, held_out):
    """NaN, Inf and a wrong shape, sent at once with good requests: each bad one INVALID_ARG,
    every good one the in-process cascade, and digits_small ran exactly the good rows."""
    x_test = held_out[0]
    good = [x_test[4 * i:4 * i + 4] for i in range(6)]
    nan, inf = x_test[24:28].copy(), x_test[28:32].copy()
    nan[1, 10], inf[2, 0] = np.nan, -np.inf
    bad = {"nan": nan, "inf": inf, "shape": np.zeros((2, 63), np.float32)}
    before = settled(server, "nv_inference_count", model=S.DIGITS_SMALL.name)
    answers = send_together(server, protocol, [*bad.values(), *good])
    for case, answer in zip(bad, answers):
        assert isinstance(answer, InferenceServerException), case
        assert answer.status() == STATUS[protocol]["INVALID_ARG"], (case, answer)
        assert S.DIGIT_PIXELS.name in str(answer), (case, answer)
    for pixels, answer in zip(good, answers[len(bad):]):
        assert isinstance(answer, dict), answer
        digit, _, escalated = digits.in_process_cascade(models, pixels, THRESHOLD)
        np.testing.assert_array_equal(answer[S.DIGIT.name][:, 0], digit)
        np.testing.assert_array_equal(answer[S.ESCALATED.name][:, 0], escalated)
    wanted = before + sum(len(pixels) for pixels in good)
    assert eventually(server, "nv_inference_count", wanted, model=S.DIGITS_SMALL.name) == wanted
    assert settled(server, "nv_inference_count", model=S.DIGITS_SMALL.name) == wanted


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_finite_input_that_drives_the_models_to_nan_fails_alone(protocol, server, models,
                                                                   held_out):
    """A row of -3e38 pixels is finite, so the input check lets it through; both digits models
    answer NaN for it (ONNX Runtime in-process says the same). Its request is INVALID_ARG
    naming the output and the input, never a NaN answer; the requests sent with it get theirs."""
    x_test = held_out[0]
    huge = x_test[40:42].copy()
    huge[0] = -3e38
    assert np.isnan(digits.probabilities(models[S.DIGITS_LARGE.name], huge[:1])).any()
    good = [x_test[4 * i:4 * i + 4] for i in range(4)]
    answers = send_together(server, protocol, [huge, *good])
    refused = answers[0]
    assert isinstance(refused, InferenceServerException), refused
    assert refused.status() == STATUS[protocol]["INVALID_ARG"], refused
    assert S.DIGIT_PROB.name in str(refused) and S.DIGIT_PIXELS.name in str(refused), refused
    for pixels, answer in zip(good, answers[1:]):
        assert isinstance(answer, dict), answer
        digit, _, _ = digits.in_process_cascade(models, pixels, THRESHOLD)
        np.testing.assert_array_equal(answer[S.DIGIT.name][:, 0], digit)
        assert np.isfinite(answer[S.DIGIT_PROB.name]).all()


def mixed_batch(models, held_out) -> tuple[np.ndarray, np.ndarray]:
    """BATCH held-out rows, a quarter of which digits_small is unsure of at the committed
    threshold, interleaved; and which those are."""
    x_test = held_out[0]
    _, _, escalated = digits.in_process_cascade(models, x_test, THRESHOLD)
    unsure, sure = np.flatnonzero(escalated)[:BATCH // 4], np.flatnonzero(~escalated)
    rows = np.sort(np.concatenate([unsure, sure[:BATCH - len(unsure)]]))
    assert len(unsure) == BATCH // 4 and len(rows) == BATCH
    return x_test[rows], escalated[rows]


@pytest.mark.parametrize("model, expected", [
    ("digits_cascade", "unsure"),
    ("digits_cascade_never", "none"),    # threshold 0
    ("digits_cascade_always", "all"),    # threshold 1.5
])
def test_only_the_unsure_rows_reach_digits_large(model, expected, server, http_client, models,
                                                  held_out):
    """Counted by Triton itself: ``nv_inference_count`` counts the rows a model ran."""
    pixels, unsure = mixed_batch(models, held_out)
    escalated = {"unsure": unsure, "none": np.zeros(BATCH, bool),
                 "all": np.ones(BATCH, bool)}[expected]
    before = settled(server, "nv_inference_count", model=S.DIGITS_LARGE.name)
    out = infer(http_client, "http", model, pixels, CASCADE_OUTPUTS)
    np.testing.assert_array_equal(out[S.ESCALATED.name][:, 0], escalated)
    wanted = before + int(escalated.sum())
    assert eventually(server, "nv_inference_count", wanted, model=S.DIGITS_LARGE.name) == wanted
    # And no more than those: the count stays there.
    assert settled(server, "nv_inference_count", model=S.DIGITS_LARGE.name) == wanted
    if expected != "none":
        large = digits.probabilities(models[S.DIGITS_LARGE.name], pixels[escalated])
        np.testing.assert_array_equal(out[S.DIGIT.name][escalated, 0], large.argmax(axis=1))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_ensemble_answers_both_models(protocol, http_client, grpc_client, models, held_out,
                                          spread):
    client = client_for(protocol, http_client, grpc_client)
    x_test = held_out[0]
    for start in range(0, 4 * BATCH, BATCH):
        pixels = x_test[start:start + BATCH]
        out = infer(client, protocol, "digits_ensemble", pixels,
                    (S.SMALL_PROBS.name, S.LARGE_PROBS.name))
        assert_served(out[S.SMALL_PROBS.name],
                      digits.probabilities(models[S.DIGITS_SMALL.name], pixels), spread,
                      S.SMALL_PROBS.name)
        assert_served(out[S.LARGE_PROBS.name],
                      digits.probabilities(models[S.DIGITS_LARGE.name], pixels), spread,
                      S.LARGE_PROBS.name)
