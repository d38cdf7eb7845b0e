"""Where a stage's outputs go with ``gpu_tensors: "on"`` (``backend.Backend.infer`` with stand-ins
for pb_utils' tensors): a pass-through output in GPU memory stays there as a DeviceTensor and
feeds the next stage by DLPack; one in CPU memory, and every other output, becomes numpy. The
same path runs live on this CPU-only server as the fallback (tests/live/test_pipelines.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bls_models import params
from bls_models import spec as S
from bls_models.backend import Backend, DeviceTensor


class FakeTensor:
    def __init__(self, name, array, on_gpu):
        self.name, self.array, self.on_gpu = name, array, on_gpu
        self.dlpack_calls = 0

    def is_cpu(self):
        return not self.on_gpu

    def as_numpy(self):
        if self.on_gpu:  # what pb_utils does for a GPU tensor
            raise RuntimeError("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self.array

    def to_dlpack(self):
        self.dlpack_calls += 1
        return ("capsule", self)


class FakeResponse:
    def has_error(self):
        return False


class FakePb:
    """The pb_utils calls ``Backend.infer`` makes; ``exec`` answers ``outputs``."""

    TRITONSERVER_MEMORY_CPU = 0

    def __init__(self, outputs):
        self.outputs = outputs
        self.inputs = []
        self.timeouts = []
        fake = self

        class Tensor(FakeTensor):
            def __init__(self, name, array):
                super().__init__(name, array, on_gpu=False)

            @staticmethod
            def from_dlpack(name, capsule):
                _, source = capsule
                return FakeTensor(name, source.array, source.on_gpu)

        class InferenceRequest:
            def __init__(self, inputs, timeout=0, **_):
                fake.inputs.append(inputs)
                fake.timeouts.append(timeout)

            def exec(self):
                return FakeResponse()

        self.Tensor, self.InferenceRequest = Tensor, InferenceRequest

    @staticmethod
    def PreferredMemory(kind, device):
        return (kind, device)

    def get_output_tensor_by_name(self, response, name):
        return self.outputs.get(name)


def infer(pb, names, keep, inputs=None, backend=None):
    return (backend or Backend(pb, "pipeline")).infer("preprocess", inputs or {}, names, "r",
                                                      lambda: 1000, frozenset(keep))


def test_a_kept_output_in_gpu_memory_stays_there_and_feeds_the_next_stage_by_dlpack():
    pixels = FakeTensor("PIXELS", np.ones((1, 3)), on_gpu=True)
    pb = FakePb({"PIXELS": pixels})
    outputs, error = infer(pb, ["PIXELS"], {"PIXELS"})
    assert error is None and isinstance(outputs["PIXELS"], DeviceTensor)
    # Both branches take it, each as a new input over the same buffer.
    for _ in ("classifier", "embedder"):
        infer(pb, [], set(), inputs={"PIXELS": outputs["PIXELS"]})
        (fed,) = pb.inputs[-1]
        assert fed.on_gpu and fed.array is pixels.array
    held = [outputs["PIXELS"]]
    Backend(pb, "pipeline").clear(held)
    assert held == []


def test_a_kept_output_in_cpu_memory_falls_back_to_numpy():
    pixels = FakeTensor("PIXELS", np.ones((1, 3)), on_gpu=False)
    outputs, error = infer(FakePb({"PIXELS": pixels}), ["PIXELS"], {"PIXELS"})
    assert error is None and outputs["PIXELS"] is pixels.array and pixels.dlpack_calls == 0


def test_outputs_that_are_not_kept_never_stay_on_the_gpu():
    # The orchestrator computes on LOGITS (top-5): it must come back in CPU memory; asking a GPU
    # tensor for numpy fails loudly rather than silently.
    logits = FakeTensor("LOGITS", np.ones((1, 1000)), on_gpu=True)
    with pytest.raises(RuntimeError, match="stored in GPU"):
        infer(FakePb({"LOGITS": logits}), ["LOGITS"], set())


def test_a_missing_output_keeps_nothing():
    pixels = FakeTensor("PIXELS", np.ones((1, 3)), on_gpu=True)
    outputs, error = infer(FakePb({"PIXELS": pixels}), ["PIXELS", "OTHER"], {"PIXELS"})
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
    assert S.PIPELINE_DEF.parse({"gpu_tensors": "on"}).gpu_tensors is True
    assert S.PIPELINE_DEF.parse({}).gpu_tensors is False
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
    pb = FakePb({"PIXELS": FakeTensor("PIXELS", np.ones((1, 3)), on_gpu=False)})
    backend = Backend(pb, "pipeline")
    held = []

    def gate():
        held.append(backend.lock._is_owned())
        return 1234

    outputs, error = backend.infer("preprocess", {}, ["PIXELS"], "r", gate)
    assert error is None and held == [True] and pb.timeouts == [1234]

    def closed():
        raise LookupError("no member wants it")

    with pytest.raises(LookupError):
        backend.infer("preprocess", {}, ["PIXELS"], "r", closed)
    assert len(pb.inputs) == 1, "a sub-request was made past a gate that refused it"


def test_what_a_late_thread_holds_after_finalize_is_kept_not_destroyed(monkeypatch):
    """A group's kept GPU outputs are let go under the lock; once the model is finalized
    nothing is destroyed (a destructor is a pb_utils call): they are kept to the process's
    exit."""
    from bls_models import backend as backend_module

    monkeypatch.setattr(backend_module, "_LEFT_AT_SHUTDOWN", [])
    pb = FakePb({})
    backend = Backend(pb, "pipeline")
    backend.finalize()
    kept = DeviceTensor(FakeTensor("PIXELS", np.ones((1, 3)), on_gpu=True))
    held = [kept]
    backend.clear(held)
    assert held == []
    assert any(kept in group for group in backend_module._LEFT_AT_SHUTDOWN
               if isinstance(group, list))
