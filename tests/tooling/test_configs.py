"""Every committed config.pbtxt is what the spec generates, parses with Triton's own proto, and
agrees with the ONNX file it serves."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from tritonclient.grpc import model_config_pb2

from bls_models import spec as S
from bls_models.spec import registered
from modelgen import configs, export

MODELS = [m.name for m in S.ALL_MODELS]
ONNX_TYPES = {name: onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
              for name, dtype in S.DTYPES.items() if dtype != "object"}


def committed(repository, name) -> model_config_pb2.ModelConfig:
    return configs.parse_pbtxt((repository / name / "config.pbtxt").read_text())


def test_every_model_directory_has_a_spec(repository):
    on_disk = {p.parent.name for p in repository.glob("*/config.pbtxt")}
    assert on_disk == set(MODELS)
    for model in S.BLS_MODELS:
        assert (repository / model.name / "1" / "model.py").is_file(), model.name


def test_committed_configs_match_the_spec(repository):
    assert configs.write_all(repository, check=True) == [], (
        "config.pbtxt differs from bls_models/spec.py: run `make configs`")


@pytest.mark.parametrize("name", MODELS)
def test_config_parses_and_is_production_ready(repository, name):
    config = committed(repository, name)
    assert config.name == name
    assert config.max_batch_size > 0
    if config.platform == "ensemble":
        assert not config.HasField("dynamic_batching") and not config.instance_group
        return
    batching = config.dynamic_batching
    assert batching.max_queue_delay_microseconds <= 5_000, "a long delay is paid at low load"
    assert all(0 < b <= config.max_batch_size for b in batching.preferred_batch_size)
    # No queue policy: with one, r24.10's batcher stops prefetching and sleeps up to 500 ms
    # while an instance is idle (docs/configuration.md, "No queue policy").
    assert not batching.HasField("default_queue_policy") and not batching.priority_levels
    expected_kind = (model_config_pb2.ModelInstanceGroup.KIND_CPU if config.backend == "python"
                     # KIND_AUTO (unset): GPU instances in the container, CPU instances here.
                     else model_config_pb2.ModelInstanceGroup.KIND_AUTO)
    for group in config.instance_group:
        assert group.kind == expected_kind
    # One instance would run one batch at a time.
    assert sum(g.count for g in config.instance_group) >= 2


def tensors_of(config) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {t.name: (t.data_type, tuple(t.dims)) for t in (*config.input, *config.output)}


@pytest.mark.parametrize("orchestrator", S.BLS_MODELS, ids=lambda m: m.name)
def test_every_tensor_an_orchestrator_uses_exists_in_its_sub_models(repository, orchestrator):
    config = committed(repository, orchestrator.name)
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    for stage, accepted in registered(orchestrator.orchestrates).contracts.items():
        sub_model = parameters[f"{stage}_model"]
        sub_tensors = tensors_of(committed(repository, sub_model))
        contract = accepted[0]  # the committed stage model is the default contract's
        assert sub_model == contract.name
        for tensor in (*contract.inputs, *contract.outputs):
            dtype = model_config_pb2.DataType.Value(tensor.dtype)
            assert sub_tensors.get(tensor.name) == (dtype, tensor.dims), (
                f"{orchestrator.name}: stage '{stage}' needs {tensor.name} {tensor.dtype} "
                f"{list(tensor.dims)} from '{sub_model}'")


def test_ensemble_steps_are_wired_to_existing_tensors(repository):
    config = committed(repository, "pipeline_ensemble")
    produced = {t.name for t in config.input}
    for step in config.ensemble_scheduling.step:
        step_config = tensors_of(committed(repository, step.model_name))
        for model_input, ensemble_tensor in step.input_map.items():
            assert model_input in step_config and ensemble_tensor in produced, step.model_name
        for model_output, ensemble_tensor in step.output_map.items():
            assert model_output in step_config, step.model_name
            produced.add(ensemble_tensor)
    assert {t.name for t in config.output} <= produced
    bls = committed(repository, "pipeline")
    assert tensors_of(bls) == tensors_of(config), "the ensemble must have pipeline's contract"


@pytest.mark.parametrize("model", S.ONNX_MODELS, ids=lambda m: m.name)
def test_config_tensors_match_the_onnx_file(repository, model):
    config = committed(repository, model.name)
    graph = onnx.load(str(export.onnx_path(repository, model))).graph
    for declared, actual in ((config.input, graph.input), (config.output, graph.output)):
        onnx_tensors = {t.name: t.type.tensor_type for t in actual}
        assert {t.name for t in declared} == set(onnx_tensors)
        for tensor in declared:
            onnx_type = onnx_tensors[tensor.name]
            dtype = model_config_pb2.DataType.Name(tensor.data_type)
            assert onnx_type.elem_type == ONNX_TYPES[dtype], tensor.name
            dims = [d.dim_value if d.HasField("dim_value") else d.dim_param
                    for d in onnx_type.shape.dim]
            assert isinstance(dims[0], str) and dims[0], f"{tensor.name}: batch axis not dynamic"
            assert dims[1:] == list(tensor.dims), tensor.name


def test_generated_pbtxt_roundtrips_through_the_proto():
    for model in S.ALL_MODELS:
        text = configs.render(model)
        assert configs.parse_pbtxt(text) == configs.to_proto(configs.config_dict(model))


def test_generator_rejects_a_field_triton_does_not_know():
    bad = configs.config_dict(S.CLASSIFIER)
    bad["dynamic_batching"]["max_queue_delay_ms"] = 1
    with pytest.raises(Exception, match="max_queue_delay_ms"):
        configs.to_proto(bad)


def test_the_python_backend_thread_pool_exceeds_every_orchestrators_subrequest_threads():
    """Each BLS call in flight holds one of the python backend's per-instance server threads and
    each response sent needs one: with no spare thread, the answers the clock sends at their
    deadlines wait behind sub-requests to a slow model (tests/live/test_degradation.py saw
    deadline errors 0.9 s late). An instance has out at once one call per pool thread
    (``subrequest_threads``)."""
    from bench.repository import variant_specs
    from modelgen import variants
    from tests.helpers import REPOSITORY
    from tritonlocal import ServerOptions

    pool = ServerOptions(model_repository=".").python_thread_pool
    orchestrators = [*S.BLS_MODELS, *variants.VARIANTS, *variants.real_model_variants(REPOSITORY),
                     *(spec for spec, _ in variant_specs(REPOSITORY))]
    threads = {m.name: registered(m.orchestrates).parse(m.parameters).subrequest_threads
               for m in orchestrators if m.orchestrates}
    assert max(threads.values()) < pool, threads
