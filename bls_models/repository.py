"""Load-time checks of an orchestrator's stage models against the model repository.

BLS is not allowed in ``initialize`` and Triton loads models in no particular order, so the
orchestrator cannot ask the server about its sub-models when it loads. It reads their
``config.pbtxt`` files beside its own instead: a stage whose model does not exist, or lacks a
tensor the stage exchanges, fails the orchestrator's load with a message that names both.
"""

from __future__ import annotations

from pathlib import Path

from bls_models import spec as S
from bls_models.params import Stage


def load_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def stage_problems(repositories: list[Path], stages: dict[str, Stage],
                   contracts: dict[str, S.ModelSpec]) -> list[str]:
    """Every problem with the stage models, looked up in ``repositories`` in order."""
    from tritonclient.grpc import model_config_pb2

    problems = []
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
        tensors = {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims))
                   for t in (*config.input, *config.output)}
        contract = contracts[name]
        for tensor in (*contract.inputs, *contract.outputs):
            found = tensors.get(tensor.name)
            if found is None:
                problems.append(f"{where}: model '{stage.model}' has no tensor '{tensor.name}'")
            elif found != (tensor.dtype, tensor.dims):
                problems.append(f"{where}: tensor '{tensor.name}' of '{stage.model}' is "
                                f"{found[0]} {list(found[1])}, the stage needs {tensor.dtype} "
                                f"{list(tensor.dims)}")
    return problems
