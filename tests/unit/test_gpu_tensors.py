"""Where a stage's outputs go with ``gpu_tensors: "on"`` (``backend.Backend.infer`` over the fake
``pb_utils``, whose KIND_GPU sub-models answer in GPU memory as r24.10's do): a pass-through
output in GPU memory stays there as a DeviceTensor and feeds the next stage by DLPack; one in
CPU memory (unless ``gpu_tensors: "always"``), and every other output, becomes numpy. The kept
path runs live on this CPU-only server with ``always`` (tests/live/test_pipelines.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bls_models import params
from bls_models import spec as S
from bls_models.backend import Backend, DeviceTensor
from tests.unit.fake_pb_utils import FakePbUtils


def fake(gpu=("preprocess",)) -> FakePbUtils:
    """``preprocess`` answering PIXELS (on KIND_GPU unless ``gpu`` says otherwise), and a
    ``classifier`` that records what it was given."""
    pb = FakePbUtils({"preprocess": lambda inputs, request: {
        "PIXELS": np.ones((len(inputs["IMAGE"]), 3), np.float32)}}, gpu=gpu)
    pb.given = []
    pb.models["classifier"] = lambda inputs, request: (pb.given.append(inputs["PIXELS"])
                                                        or {"LOGITS": inputs["PIXELS"] * 2})
    return pb


def infer(backend, names, keep, model="preprocess", inputs=None, gate=lambda: 1000):
    return backend.infer(model, inputs or {"IMAGE": np.zeros((2, 4), np.uint8)}, names, "r",
                         gate, frozenset(keep))


def backend_over(pb) -> Backend:
    backend = Backend(pb, "pipeline")
    pb.object_lock = backend.lock
    return backend


def test_a_kept_output_in_gpu_memory_stays_there_and_feeds_the_next_stage_by_dlpack():
    pb = fake()
    backend = backend_over(pb)
    outputs, error = infer(backend, ["PIXELS"], {"PIXELS"})
    assert error is None and isinstance(outputs["PIXELS"], DeviceTensor)
    assert not outputs["PIXELS"].tensor.is_cpu() and len(outputs["PIXELS"]) == 2
    # Both branches take it, each as a new input over the same GPU buffer.
    for _ in ("classifier", "embedder"):
        got, error = infer(backend, ["LOGITS"], set(), "classifier",
                           {"PIXELS": outputs["PIXELS"]})
        assert error is None and got["LOGITS"].shape == (2, 3)
    assert pb.given[0] is pb.given[1]
    held = [outputs["PIXELS"]]
    backend.clear(held)
    assert held == [] and outputs["PIXELS"].tensor is None  # freed under the lock
    assert pb.violations == []


def test_a_kept_output_in_cpu_memory_falls_back_to_numpy_unless_kept_anywhere():
    pb = fake(gpu=())
    backend = backend_over(pb)
    outputs, error = infer(backend, ["PIXELS"], {"PIXELS"})
    assert error is None and isinstance(outputs["PIXELS"], np.ndarray)
    backend.keep_host = True  # gpu_tensors "always": the GPU path, in host memory
    outputs, error = infer(backend, ["PIXELS"], {"PIXELS"})
    assert error is None and isinstance(outputs["PIXELS"], DeviceTensor)
    assert outputs["PIXELS"].tensor.is_cpu()
    backend.clear([outputs["PIXELS"]])
    assert pb.violations == []


def test_outputs_that_are_not_kept_are_asked_for_in_host_memory():
    # The orchestrator computes on them (top-5): asked for in CPU memory, they arrive there.
    pb = fake(gpu=("preprocess", "classifier"))
    outputs, error = infer(backend_over(pb), ["LOGITS"], set(), "classifier",
                           {"PIXELS": np.ones((1, 3), np.float32)})
    assert error is None and isinstance(outputs["LOGITS"], np.ndarray)
    assert pb.output_memory == [("classifier", (pb.TRITONSERVER_MEMORY_CPU, 0))]


def test_a_gpu_tensor_refuses_numpy_as_r24_10_does():
    """``as_numpy()`` of a tensor in GPU memory raises (r24.10 ``pb_tensor.cc`` 518-520); a
    DLPack capsule is consumed once."""
    from tests.unit.fake_pb_utils import TritonModelException

    pb = fake()
    request = pb.InferenceRequest(model_name="preprocess", requested_output_names=["PIXELS"],
                                  inputs=[pb.Tensor("IMAGE", np.zeros((1, 4), np.uint8))])
    tensor = pb.get_output_tensor_by_name(request.exec(), "PIXELS")
    assert not tensor.is_cpu()
    with pytest.raises(TritonModelException, match="stored in GPU"):
        tensor.as_numpy()
    capsule = tensor.to_dlpack()
    assert not pb.Tensor.from_dlpack("PIXELS", capsule).is_cpu()
    with pytest.raises(TritonModelException, match="consumed"):
        pb.Tensor.from_dlpack("PIXELS", capsule)


def test_a_missing_output_keeps_nothing():
    pb = fake()
    outputs, error = infer(backend_over(pb), ["PIXELS", "OTHER"], {"PIXELS"})
    assert outputs is None and error == "the response has no output 'OTHER'"


def test_only_pass_through_outputs_are_kept_and_the_parameter_parses():
    assert S.PIPELINE_DEF.pass_through == {"preprocess": ("PIXELS",)}
    assert S.TAG_PIPELINE_DEF.pass_through == {}
    # A pass-through output must be the stage's output and never the pipeline's.
    with pytest.raises(ValueError, match="pass-through"):
        dataclasses.replace(S.PIPELINE_DEF, outputs=(*S.PIPELINE_DEF.outputs, S.PIXELS))
    with pytest.raises(ValueError, match="pass-through"):
        dataclasses.replace(S.PIPELINE_DEF, stages=(
            S.StageDef("preprocess", (S.PREPROCESS,), pass_through=("LOGITS",)),
            *S.PIPELINE_DEF.stages[1:]))
    assert S.PIPELINE_DEF.parse({"gpu_tensors": "on"}).gpu_tensors == "on"
    assert S.PIPELINE_DEF.parse({"gpu_tensors": "always"}).gpu_tensors == "always"
    assert S.PIPELINE_DEF.parse({}).gpu_tensors == "off"
    with pytest.raises(params.ConfigError, match="gpu_tensors"):
        S.PIPELINE_DEF.parse({"gpu_tensors": "yes"})


def test_the_placement_follows_the_stage_models_instance_kind(repository, tmp_path):
    """GPU output memory is only asked of KIND_GPU stage models: the committed (portable)
    repository's preprocess has no kind, the GPU profiles' has KIND_GPU."""
    from bls_models.repository import stage_kinds
    from modelgen import profiles

    stages = S.PIPELINE_DEF.parse({}).stages
    assert stage_kinds([repository], stages)["preprocess"] == {"KIND_AUTO"}
    profiles.write("gpu", repository, tmp_path / "gpu")
    assert stage_kinds([tmp_path / "gpu"], stages) == {s: {"KIND_GPU"} for s in stages}


def gpu_orchestrator(pb, repository, tmp_path, device_id: str, **parameters: str):
    """``pipeline`` as the GPU profile renders it (preprocess KIND_GPU, gpu_tensors on), run by
    the runtime over a fake pb_utils, as an instance with ``device_id``."""
    import json

    from bls_models.triton_runtime import Orchestrator
    from modelgen import profiles

    rendered = tmp_path / "gpu"
    profiles.write("gpu", repository, rendered)
    config = profiles.profile_config(S.PIPELINE, "gpu")
    config["parameters"].update({k: {"string_value": v} for k, v in parameters.items()})
    return Orchestrator(pb, {"model_name": "pipeline", "model_config": json.dumps(config),
                             "model_repository": str(rendered / "pipeline"),
                             "model_instance_kind": "CPU",
                             "model_instance_device_id": device_id}, "pipeline")


@pytest.mark.parametrize("device_id", ["0", "3"])
def test_kept_outputs_stay_on_the_gpu_that_produced_them_not_on_gpu_0(made, repository, tmp_path,
                                                                       device_id):
    """On a multi-GPU host the scheduler runs preprocess on any GPU's instance. The sub-request
    names no device for PIXELS, so Triton leaves it in that instance's own GPU memory; naming
    GPU 0 (as before) put every image's PIXELS on GPU 0, with a device-to-device copy from the
    others. The orchestrator's own device id cannot help: KIND_CPU instances all report 0."""
    from tests.helpers import image_inputs, sub_models
    from tests.unit.fake_pb_utils import FakePbUtils, Request

    pb = FakePbUtils(sub_models())
    made.append(orchestrator := gpu_orchestrator(pb, repository, tmp_path, device_id))
    assert orchestrator.keep == {"preprocess": frozenset({"PIXELS"})}
    request = Request(image_inputs(2), request_id="r")
    pb.execute(orchestrator, [request])
    (response,) = request.answers
    assert not response.has_error(), response.error().message()
    memory = dict(pb.output_memory)
    assert memory["preprocess"] is None  # Triton's default: where the producing instance put it
    cpu = pb.PreferredMemory(pb.TRITONSERVER_MEMORY_CPU, 0)
    assert memory["classifier"] == memory["embedder"] == cpu  # top-5 and the answer need host memory


def test_without_gpu_tensors_every_output_is_asked_for_in_cpu_memory(made, repository, tmp_path):
    from tests.helpers import image_inputs, sub_models
    from tests.unit.fake_pb_utils import FakePbUtils, Request

    pb = FakePbUtils(sub_models())
    made.append(orchestrator := gpu_orchestrator(pb, repository, tmp_path, "0", gpu_tensors="off"))
    request = Request(image_inputs(), request_id="r")
    pb.execute(orchestrator, [request])
    cpu = pb.PreferredMemory(pb.TRITONSERVER_MEMORY_CPU, 0)
    assert {model: memory for model, memory in pb.output_memory} == {
        "preprocess": cpu, "classifier": cpu, "embedder": cpu}


def test_the_gate_gives_the_sub_requests_timeout_under_the_lock_or_stops_it():
    """``gate`` is asked, under the backend's lock, just before the request is made: its answer
    is the sub-request's timeout (µs); what it raises sends nothing and reaches the caller."""
    pb = fake(gpu=())
    backend = backend_over(pb)
    held = []

    def gate():
        held.append(backend.lock._is_owned())
        return 1234

    outputs, error = infer(backend, ["PIXELS"], set(), gate=gate)
    assert error is None and held == [True] and [s.timeout_us for s in pb.sent] == [1234]

    def closed():
        raise LookupError("no member wants it")

    with pytest.raises(LookupError):
        infer(backend, ["PIXELS"], set(), gate=closed)
    assert len(pb.sent) == 1, "a sub-request was made past a gate that refused it"


def test_what_a_late_thread_holds_after_finalize_is_kept_not_destroyed(monkeypatch):
    """A group's kept GPU outputs are let go under the lock; once the model is finalized
    nothing is destroyed (a destructor is a pb_utils call): they are kept to the process's
    exit."""
    from bls_models import backend as backend_module

    monkeypatch.setattr(backend_module, "_LEFT_AT_SHUTDOWN", [])
    pb = fake()
    backend = backend_over(pb)
    outputs, _ = infer(backend, ["PIXELS"], {"PIXELS"})
    kept = outputs["PIXELS"]
    backend.finalize()
    held = [kept]
    backend.clear(held)
    assert held == []
    assert any(kept in group for group in backend_module._LEFT_AT_SHUTDOWN
               if isinstance(group, list))


def test_the_gpu_profile_keeps_pixels_on_the_gpu_and_frees_them_under_the_lock(made,
                                                                             monkeypatch):
    """Under the GPU profile the classifier and embedder get PIXELS as the preprocess
    instance's own GPU tensor, by DLPack, never through host memory; it is freed under the
    backend's lock (the fake checks it) when the group ends."""
    from tests import helpers
    from tests.unit.fake_pb_utils import Request
    from tests.unit.test_profiles import MODELS, inputs_for, make

    monkeypatch.setattr(helpers, "profile", "gpu")
    seen = []
    models = dict(MODELS)
    for stage in ("classifier", "embedder"):
        def spy(inputs, request, run=models[stage]):
            seen.append(inputs["PIXELS"])
            return run(inputs, request)
        models[stage] = spy
    pb = FakePbUtils(models)
    made.append(orchestrator := make(pb, "pipeline"))
    assert orchestrator.keep == {"preprocess": frozenset({"PIXELS"})}
    request = Request(inputs_for("pipeline", np.random.default_rng(3)), request_id="g")
    pb.execute(orchestrator, [request])
    assert not request.answer.has_error(), request.answer.error().message()
    assert len(seen) == 2 and seen[0] is seen[1], "PIXELS did not go to both stages as one tensor"


def test_a_kept_tensor_selects_every_row_and_refuses_a_part():
    """What a run function can do with a kept tensor: ``setup.rows`` of a run whose rows all
    asked (``slice(None)``, or every index) gives it back; a part of it cannot be taken on the
    GPU without a GPU array library, so asking for one is the pipeline's bug (a TypeError)."""
    kept = DeviceTensor(object(), rows=3)
    assert kept[slice(None)] is kept and kept[[0, 1, 2]] is kept and len(kept) == 3
    with pytest.raises(TypeError, match="rows"):
        kept[[0, 2]]
