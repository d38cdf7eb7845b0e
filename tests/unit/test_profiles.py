"""Every pipeline under both profiles, over the fake ``pb_utils``: ``pipeline``, ``tag_pipeline``,
``digits_cascade`` and docs/extending.md's ``image_embedding``, each made from the committed
(CPU) configs and from the GPU profile as rendered, where the fake answers a KIND_GPU sub-model's
outputs in GPU memory unless the sub-request asks for host memory (as r24.10 does). A batch of
requests asking for every output, for some, and for one each (output pruning, mixed in one
group) must give each request what the pipeline computes for it alone, in-process; the fake's
invariants are checked after each test (``made``)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from bls_models import drive
from bls_models import spec as S
from bls_models.triton_runtime import Orchestrator
from modelgen import configs
from tests import helpers
from tests.unit.fake_pb_utils import FakePbUtils, Request

pytestmark = pytest.mark.usefixtures("profile")


def row_model(contract: S.ModelSpec):
    """A stand-in for ``contract``'s model whose every output row is a function of its input
    row alone (so grouping and batching cannot change an answer)."""
    def run(inputs, request):
        first = inputs[contract.inputs[0].name]
        rows = len(first)
        key = first.reshape(rows, -1).astype(np.float64).sum(axis=1)
        fraction = (key % 89) / 89.0  # in [0, 1): a digit model's top probability
        outputs = {}
        for tensor in contract.outputs:
            dims = tuple(first.shape[1] if d < 0 else d for d in tensor.dims)
            size = int(np.prod(dims))
            dtype = S.DTYPES[tensor.dtype]
            if np.dtype(dtype).kind == "f":
                values = fraction[:, None] * np.linspace(0.1, 1.0, size)[None, :]
            else:
                values = (key.astype(np.int64) % 13)[:, None] + np.arange(size)[None, :] % 5
            outputs[tensor.name] = values.reshape(rows, *dims).astype(dtype)
        return outputs
    return run


MODELS = {m.name: row_model(m) for m in (S.PREPROCESS, S.CLASSIFIER, S.EMBEDDER, S.TAGGER_TAGS,
                                         S.DIGITS_SMALL, S.DIGITS_LARGE)}


def extending_definition():
    """docs/extending.md's pipeline, from the page's model.py block."""
    namespace: dict = {}
    exec(compile(helpers.page_model_py(), "docs/extending.md", "exec"), namespace)
    return namespace["IMAGE_EMBEDDING"]


def make(pb: FakePbUtils, model: str):
    if model != helpers.EXTENDING_NAME:
        return helpers.orchestrator(pb, model)
    definition = extending_definition()
    config = configs.config_dict(definition.model_spec())
    directory = helpers.REPOSITORY
    if helpers.profile != "cpu":  # what the GPU profile gives a pipeline with pass-through outputs
        directory = helpers.rendered_repository(helpers.profile)
        config["parameters"]["gpu_tensors"] = {"string_value": "on"}
        pb.gpu = frozenset(helpers.gpu_models(directory))
    made = Orchestrator(pb, {"model_name": model, "model_config": json.dumps(config),
                             "model_repository": str(directory / model)}, definition)
    pb.object_lock = made.backend.lock
    return made


def inputs_for(model: str, rng, tokens: int = 700) -> dict[str, np.ndarray]:
    if model in ("pipeline", helpers.EXTENDING_NAME):
        return {"IMAGE": rng.integers(0, 255, (1, *S.IMAGE.dims), dtype=np.uint8)}
    if model == "tag_pipeline":
        return {"TOKENS": rng.integers(0, S.TAGGER_VOCAB, (1, tokens), dtype=np.int64)}
    return {"DIGIT_PIXELS": rng.uniform(0, 16, (1, 64)).astype(np.float32)}


def alone(orchestrator: Orchestrator, request: Request) -> dict[str, np.ndarray]:
    """What the pipeline computes for ``request`` alone, in-process (no pb_utils, host memory)."""
    inputs = {name: request.input(name) for name in orchestrator.input_names}
    every = list(orchestrator.output_dtypes)
    wanted = request._outputs or every
    setup = orchestrator.setup
    if set(wanted) != set(every):
        setup = replace(setup, asked=((len(next(iter(inputs.values()))), frozenset(wanted)),))

    def send(call):
        model = orchestrator.config.stages[call.stage].model
        outputs = MODELS[model](call.inputs, None)
        return call.reduce(outputs) if call.reduce else outputs

    outputs = drive.drive(orchestrator.run(inputs, drive.Call, setup), send)
    return {name: outputs[name] for name in wanted}


OUTPUT_MIXES = {
    "pipeline": [(), ("EMBEDDING",), ("CLASS_IDS", "CLASS_PROBS"), (), ("CLASS_PROBS",)],
    helpers.EXTENDING_NAME: [(), ("NORM",), ("TOP_CLASS",), ("EMBEDDING", "TOP_CLASS")],
    "tag_pipeline": [(), ("TAGS",), (), ("TAG_PROBS",)],
    "digits_cascade": [(), ("DIGIT",), ("ESCALATED", "DIGIT_PROB"), ()],
}


@pytest.mark.parametrize("mixed", [False, True], ids=["every-output", "mixed-outputs"])
@pytest.mark.parametrize("model", list(OUTPUT_MIXES))
def test_each_request_gets_what_its_pipeline_computes_for_it_alone(made, model, mixed):
    pb = FakePbUtils(dict(MODELS))
    made.append(orchestrator := make(pb, model))
    rng = np.random.default_rng(7)
    asks = OUTPUT_MIXES[model] if mixed else [()] * 4
    requests = [Request(inputs_for(model, rng, tokens=300 + 400 * (i % 2)),
                        request_id=f"{model}-{i}", outputs=asked)
                for i, asked in enumerate(asks)]
    pb.execute(orchestrator, requests)
    for request in requests:
        response = request.answer
        assert not response.has_error(), response.error().message()
        got = {t.name(): t.as_numpy() for t in response.output_tensors}
        wanted = alone(orchestrator, request)
        assert set(got) == set(wanted)
        for name, value in wanted.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
    if helpers.profile == "gpu" and model in ("pipeline", helpers.EXTENDING_NAME):
        memory = [m for name, m in pb.output_memory if name == "preprocess"]
        # PIXELS stays on the GPU for a group whose every request wants every output; a group
        # with mixed requests selects rows of it, so it is asked for in host memory.
        assert memory == ([pb.PreferredMemory(pb.TRITONSERVER_MEMORY_CPU, 0)] if mixed
                          else [None])
