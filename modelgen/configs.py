"""Generate every ``config.pbtxt`` from ``bls_models.spec``.

The configs are committed (operators read and diff them), but they are never edited by hand:
``python -m modelgen.configs`` rewrites them and ``--check`` (run by the tests) fails when a
committed file differs from what the spec says. Each config is built as a dict, parsed into
Triton's own ``ModelConfig`` protobuf (so an unknown field or a bad enum fails here, not at server
start) and printed with protobuf's text format — the format Triton reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from bls_models import repository
from bls_models import spec as S

HEADER = "# Generated from bls_models/spec.py by `python -m modelgen.configs`; do not edit.\n"


def config_dict(model: S.ModelSpec) -> dict:
    """The model config of ``model`` as a dict in the protobuf JSON mapping."""
    config: dict = {"name": model.name}
    if model.platform:
        config["platform"] = model.platform
    else:
        config["backend"] = model.backend
    config.update({
        "max_batch_size": model.max_batch_size,
        "input": [_tensor(t) for t in model.inputs],
        "output": [_tensor(t) for t in model.outputs],
    })
    if model.batching is not None:
        batching = model.batching
        config["dynamic_batching"] = {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": batching.queue_timeout_us,
                "allow_timeout_override": True,
                "max_queue_size": batching.max_queue_size,
            },
        }
    if model.instance_count:
        # No `kind` unless the spec requires one: KIND_AUTO places instances on every GPU in the
        # container and on the CPU here.
        group: dict = {"count": model.instance_count}
        if model.kind:
            group["kind"] = model.kind
        config["instance_group"] = [group]
    if model.decoupled:
        config["model_transaction_policy"] = {"decoupled": True}
    if model.ensemble_steps:
        config["ensemble_scheduling"] = {"step": [
            {"model_name": step.model, "model_version": -1,
             "input_map": dict(step.input_map), "output_map": dict(step.output_map)}
            for step in model.ensemble_steps
        ]}
    if model.parameters:
        config["parameters"] = {k: {"string_value": v} for k, v in model.parameters.items()}
    return config


def _tensor(tensor: S.TensorSpec) -> dict:
    return {"name": tensor.name, "data_type": tensor.dtype, "dims": list(tensor.dims)}


def to_proto(config: dict) -> model_config_pb2.ModelConfig:
    return json_format.ParseDict(config, model_config_pb2.ModelConfig())


def render(model: S.ModelSpec) -> str:
    return HEADER + text_format.MessageToString(to_proto(config_dict(model)))


parse_pbtxt = repository.parse_config  # the one parser, shared with the orchestrators

def write_all(repository: Path, check: bool = False) -> list[str]:
    """Write (or, with ``check``, compare) every config; return the names that differ."""
    stale = []
    for model in S.ALL_MODELS:
        path = repository / model.name / "config.pbtxt"
        if model.platform == "ensemble":
            (repository / model.name / "1").mkdir(parents=True, exist_ok=True)
        wanted = render(model)
        current = path.read_text() if path.exists() else None
        if current == wanted:
            continue
        stale.append(model.name)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--check", action="store_true", help="fail if a committed config differs")
    args = parser.parse_args(argv)
    stale = write_all(args.repository, check=args.check)
    if args.check and stale:
        print(f"config.pbtxt out of date for: {', '.join(stale)} "
              "(run `python -m modelgen.configs`)", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote {args.repository / name / 'config.pbtxt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
