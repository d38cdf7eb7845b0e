"""docs/cascade.md's "Your own cascade" as written: a user's cascade, from the section's one
model.py and its config command, served by a real tritonserver beside ``digits_small`` and
``digits_large``, answering what the repository's cascade computes in-process, row for row, and
sending ``second`` only the rows ``first`` is unsure of (Triton's own count)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bls_models import repository as repository_files
from bls_models import spec as S
from bls_models.pipelines import contract_problems
from modelgen import configs, digits
from tests.helpers import CASCADE_TEMPLATE_NAME as NAME
from tests.helpers import (
    assert_served,
    batch_spread,
    cascade_page_config_command,
    cascade_page_model_py,
    eventually,
    extending_checkout,
    server_options,
    settled,
)
from tritonlocal import TritonServer

BATCH = 16
OUTPUTS = (S.DIGIT.name, S.DIGIT_PROB.name, S.ESCALATED.name)


@pytest.fixture(scope="module")
def checkout(repository, tmp_path_factory):
    """A user's checkout: the digits models, plus the section's model directory and the config
    its command writes."""
    work = tmp_path_factory.mktemp("cascade_template")
    command = cascade_page_config_command()
    assert command[-1] == f"model_repository/{NAME}/1/model.py", command
    repo = extending_checkout(work, repository, cascade_page_model_py(), name=NAME,
                              stage_models=(S.DIGITS_SMALL, S.DIGITS_LARGE), command=command)
    return work, repo


@pytest.fixture(scope="module")
def user_server(checkout):
    work, repo = checkout
    with TritonServer(server_options(repo, work)) as server:
        yield server


@pytest.fixture(scope="module")
def served_config(checkout) -> dict[str, str]:
    """The parameters of the config the section's command wrote, as the server reads them."""
    config = repository_files.load_config(checkout[1] / NAME / "config.pbtxt")
    return {key: value.string_value for key, value in config.parameters.items()}


@pytest.fixture(scope="module")
def threshold(served_config) -> float:
    """The section's default threshold, as its config serves it."""
    return float(served_config["threshold"])


@pytest.fixture(scope="module")
def models(repository):
    return digits.sessions(repository)


@pytest.fixture(scope="module")
def held_out() -> np.ndarray:
    return digits.split()[1]


@pytest.fixture(scope="module")
def spread(models, held_out):
    """How much in-process ONNX Runtime itself moves a probability between batch compositions:
    what a served probability may differ by."""
    pixels = held_out[:BATCH]
    return max(batch_spread(lambda x, name=name: [digits.probabilities(models[name], x)], pixels,
                            S.DIGITS_LARGE.max_batch_size)[0]
               for name in digits.MODELS)


def infer(server, protocol: str, pixels: np.ndarray) -> dict[str, np.ndarray]:
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if protocol == "http"
                                          else server.grpc_url)
    tensor = module.InferInput(S.DIGIT_PIXELS.name, list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels)
    result = client.infer(NAME, [tensor],
                          outputs=[module.InferRequestedOutput(name) for name in OUTPUTS])
    return {name: result.as_numpy(name) for name in OUTPUTS}


def test_the_sections_command_checks_the_contracts_and_writes_the_config(checkout, served_config):
    """The config the command wrote is its definition's, every parameter at its default, the
    stage models named by the contracts, and the pipeline keeps to both contracts."""
    model_py = checkout[1] / NAME / "1" / "model.py"
    definition = configs.definition_in(model_py)
    assert definition.name == NAME
    assert contract_problems(definition) == []
    assert (model_py.parent.parent / "config.pbtxt").read_text() == configs.render(
        definition.model_spec())
    assert served_config["first_model"] == S.DIGITS_SMALL.name
    assert served_config["second_model"] == S.DIGITS_LARGE.name
    assert served_config["threshold"] == next(
        p.default for p in definition.parameters if p.name == "threshold")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_sections_cascade_is_the_in_process_cascade_row_for_row(user_server, protocol, models,
                                                                    held_out, threshold, spread):
    escalated_rows = 0
    for start in range(0, len(held_out), BATCH):
        pixels = held_out[start:start + BATCH]
        out = infer(user_server, protocol, pixels)
        digit, prob, escalated = digits.in_process_cascade(models, pixels, threshold)
        assert out[S.DIGIT.name].dtype == np.int64 and out[S.ESCALATED.name].dtype == np.bool_
        np.testing.assert_array_equal(out[S.ESCALATED.name], escalated[:, None])
        np.testing.assert_array_equal(out[S.DIGIT.name], digit[:, None])
        assert_served(out[S.DIGIT_PROB.name], prob[:, None], spread, S.DIGIT_PROB.name)
        escalated_rows += int(escalated.sum())
    # A cascade's answers: some rows went to `second`, most did not.
    assert 0 < escalated_rows < len(held_out) / 2


def mixed_batch(models, held_out, threshold) -> tuple[np.ndarray, np.ndarray]:
    """BATCH held-out rows, a quarter of which `first` is unsure of at ``threshold``,
    interleaved; and which those are."""
    _, _, escalated = digits.in_process_cascade(models, held_out, threshold)
    unsure, sure = np.flatnonzero(escalated)[:BATCH // 4], np.flatnonzero(~escalated)
    rows = np.sort(np.concatenate([unsure, sure[:BATCH - len(unsure)]]))
    assert len(unsure) == BATCH // 4 and len(rows) == BATCH
    return held_out[rows], escalated[rows]


def test_only_the_unsure_rows_reach_the_second_model(user_server, models, held_out, threshold):
    """Counted by Triton itself: ``nv_inference_count`` counts the rows a model ran."""
    pixels, unsure = mixed_batch(models, held_out, threshold)
    counts = {m.name: settled(user_server, "nv_inference_count", model=m.name)
              for m in (S.DIGITS_SMALL, S.DIGITS_LARGE)}
    out = infer(user_server, "http", pixels)
    np.testing.assert_array_equal(out[S.ESCALATED.name][:, 0], unsure)
    wanted = {S.DIGITS_SMALL.name: counts[S.DIGITS_SMALL.name] + BATCH,
              S.DIGITS_LARGE.name: counts[S.DIGITS_LARGE.name] + int(unsure.sum())}
    for model, count in wanted.items():
        assert eventually(user_server, "nv_inference_count", count, model=model) == count, model
        # And no more than those: the count stays there.
        assert settled(user_server, "nv_inference_count", model=model) == count, model
