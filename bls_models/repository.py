"""What an orchestrator learns when it loads: its parameters, and its stage models checked
against the model repository (``plan``).

BLS is not allowed in ``initialize`` and Triton loads models in no particular order, so the
orchestrator cannot ask the server about its sub-models when it loads. It reads their
``config.pbtxt`` files beside its own instead: a stage whose model does not exist, or lacks a
tensor the stage exchanges, fails the orchestrator's load with a message that names both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bls_models import params
from bls_models import spec as S
from bls_models.definition import PipelineDef, Setup
from bls_models.params import Stage


@dataclass(frozen=True)
class Plan:
    """An orchestrator as loaded: its parsed parameters, its run function and check, per stage
    the contract its model meets and the most rows it takes, and what its own config says."""

    config: params.OrchestratorConfig
    contracts: dict
    run: object
    check: object
    setup: Setup
    batching: frozenset      # stages whose model batches (``max_batch_size`` > 0)
    input_names: list
    output_types: dict       # output name -> Triton dtype ("TYPE_FP32")
    first_stage: str
    group_rows: int          # the most rows run as one group
    keep: dict               # stage -> outputs kept on the GPU (gpu_tensors)


def plan(args: dict, definition: PipelineDef) -> Plan:
    """``initialize``'s ``args`` and ``definition`` as a ``Plan``; raises ``params.ConfigError``
    naming every problem."""
    model = args["model_name"]
    config = json.loads(args["model_config"])
    if (config.get("model_transaction_policy") or {}).get("decoupled"):
        raise params.ConfigError(f"orchestrator '{model}' answers one response per request: "
                                 "remove model_transaction_policy { decoupled }")
    parsed = definition.parse(params.string_parameters(config))
    # This model's own repository first (the parent of its directory), then any others.
    repositories = [Path(args["model_repository"]).parent,
                    *(Path(p) for p in parsed.stage_model_repositories)]
    # Which contract each stage model meets decides, e.g., whether the tagger reduces.
    contracts, problems = resolve_stages(repositories, parsed.stages, definition.contracts)
    if problems:
        raise params.ConfigError("; ".join(problems))
    rows = stage_max_batch(repositories, parsed.stages)  # 0: the stage does not batch
    # gpu_tensors: a stage's pass-through outputs stay on the GPU only if its model is
    # configured KIND_GPU. Asking a CPU instance for GPU output memory fails the sub-request
    # ("BackendMemory::Create, all allocation types failed"), so other stages keep the copy.
    kinds = stage_kinds(repositories, parsed.stages)
    return Plan(
        config=parsed, contracts=contracts, run=definition.run_function(),
        check=definition.check_function(),
        setup=Setup(options=parsed.options, contracts=contracts,
                    max_rows={stage: max(n, 1) for stage, n in rows.items()}),
        batching=frozenset(stage for stage, n in rows.items() if n > 0),
        input_names=[t["name"] for t in config["input"]],
        output_types={t["name"]: t["data_type"] for t in config["output"]},
        first_stage=definition.stages[0].name,
        group_rows=min([max(1, int(config.get("max_batch_size", 0)))]
                       + [n for n in rows.values() if n > 0]),
        keep={stage: frozenset(names) for stage, names in definition.pass_through.items()
              if parsed.gpu_tensors == "always"
              or (parsed.gpu_tensors == "on" and kinds.get(stage) == {"KIND_GPU"})})


def onnx_path(repository: Path, model: S.ModelSpec, version: int = 1) -> Path:
    """Where ``model``'s ONNX file lies in ``repository`` (modelgen.export writes it there)."""
    return repository / model.name / str(version) / "model.onnx"


def parse_config(text: str):
    """A config.pbtxt's text as Triton's model config loader reads it: protobuf text format into
    ``ModelConfig`` (an unknown field or a bad enum raises). The project's one pbtxt parser."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def load_config(path: Path):
    return parse_config(Path(path).read_text())


def resolve_stages(repositories: list[Path], stages: dict[str, Stage],
                   contracts: dict[str, tuple[S.ModelSpec, ...]]
                   ) -> tuple[dict[str, S.ModelSpec], list[str]]:
    """The contract each stage's model meets (the first of the stage's accepted ones), looked up
    in ``repositories`` in order, and every problem found."""
    chosen: dict[str, S.ModelSpec] = {}
    problems: list[str] = []
    for name, stage in stages.items():
        where = f"stage '{name}' (parameter {name}_model = '{stage.model}')"
        candidates = [r / stage.model / "config.pbtxt" for r in repositories]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            searched = ", ".join(str(r) for r in repositories)
            problems.append(f"{where}: no model '{stage.model}' in {searched}")
            continue
        try:
            config = load_config(path)
        except Exception as error:  # noqa: BLE001 - any parse failure is reported as such
            problems.append(f"{where}: cannot parse {path}: {error}")
            continue
        accepted = contracts[name]
        mismatches = [_mismatches(config, stage.model, contract) for contract in accepted]
        fit = next((c for c, m in zip(accepted, mismatches) if not m), None)
        if fit is not None:
            chosen[name] = fit
        elif len(accepted) == 1:
            problems += [f"{where}: {m}" for m in mismatches[0]]
        else:
            problems.append(f"{where}: model '{stage.model}' meets none of the stage's contracts: "
                            + "; ".join(f"like '{c.name}', " + ", ".join(m)
                                        for c, m in zip(accepted, mismatches)))
    return chosen, problems


def stage_problems(repositories: list[Path], stages: dict[str, Stage],
                   contracts: dict[str, tuple[S.ModelSpec, ...]]) -> list[str]:
    """Every problem with the stage models (see ``resolve_stages``)."""
    return resolve_stages(repositories, stages, contracts)[1]


def _mismatches(config, model: str, contract: S.ModelSpec) -> list[str]:
    """How a parsed model config falls short of ``contract``'s tensors."""
    from tritonclient.grpc import model_config_pb2

    tensors = {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims))
               for t in (*config.input, *config.output)}
    problems = []
    for tensor in (*contract.inputs, *contract.outputs):
        found = tensors.get(tensor.name)
        if found is None:
            problems.append(f"model '{model}' has no tensor '{tensor.name}'")
        elif found != (tensor.dtype, tensor.dims):
            problems.append(f"tensor '{tensor.name}' of '{model}' is {found[0]} "
                            f"{list(found[1])}, the stage needs {tensor.dtype} {list(tensor.dims)}")
    return problems


def stage_configs(repositories: list[Path], stages: dict[str, Stage]) -> dict[str, object]:
    """Stage -> its model's parsed config, found in ``repositories`` in order. Stages whose
    config is missing are left out (``resolve_stages`` reports them)."""
    configs = {}
    for name, stage in stages.items():
        path = next((r / stage.model / "config.pbtxt" for r in repositories
                     if (r / stage.model / "config.pbtxt").is_file()), None)
        if path is not None:
            configs[name] = load_config(path)
    return configs


def stage_kinds(repositories: list[Path], stages: dict[str, Stage]) -> dict[str, set[str]]:
    """Stage -> the instance-group kinds its model's config declares ("KIND_AUTO" when a group
    has no kind, or the model has no instance_group)."""
    from tritonclient.grpc import model_config_pb2

    return {name: ({model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)
                    for g in config.instance_group} or {"KIND_AUTO"})
            for name, config in stage_configs(repositories, stages).items()}


def stage_max_batch(repositories: list[Path], stages: dict[str, Stage]) -> dict[str, int]:
    """Stage -> its model's ``max_batch_size`` (0: it does not batch)."""
    return {name: config.max_batch_size
            for name, config in stage_configs(repositories, stages).items()}
