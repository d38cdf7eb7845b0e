"""How much ``/dev/shm`` the servers of a set of model repositories need: the rule of
docs/operations.md ("Shared memory"), computed from the configs.

Every python-backend instance (stub) maps a region of ``shm-default-byte-size`` (32 MiB here)
when it starts; a region grows in steps of ``shm-growth-byte-size`` (16 MiB) and never shrinks.
The python backend only ``ftruncate``s a region: a ``/dev/shm`` too small for the regions' growth
goes unnoticed at start and kills a stub with SIGBUS under a later burst. So ``/dev/shm`` must
hold

    stubs x 32 MiB  +  the growth of the stubs that pass large tensors

A large tensor has more than ``LARGE_ROW_BYTES`` (1 MiB) per batch row: the tagger's 28.7 MB of
logits per sequence, not the 602 KB of PIXELS per image (measured: no growth past 32 MiB). A
stub's growth is what it can hold at once, rounded up to whole growth steps:

* an orchestrator (a python model with a ``subrequest_threads`` parameter): one sub-response per
  sub-request thread, each with up to its stage model's ``max_batch_size`` rows of that model's
  large outputs (the stage models are the ``*_model`` parameters);
* any other python model: one batch (``max_batch_size`` rows) of its own large outputs.

``python -m tritonlocal.shm REPOSITORY...`` prints the budget.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from tritonlocal import flags, launcher, liveness

MIB = 2**20
LARGE_ROW_BYTES = MIB
DTYPE_BYTES = {"TYPE_BOOL": 1, "TYPE_UINT8": 1, "TYPE_INT8": 1, "TYPE_UINT16": 2, "TYPE_INT16": 2,
               "TYPE_FP16": 2, "TYPE_BF16": 2, "TYPE_UINT32": 4, "TYPE_INT32": 4, "TYPE_FP32": 4,
               "TYPE_UINT64": 8, "TYPE_INT64": 8, "TYPE_FP64": 8}


@dataclass(frozen=True)
class Budget:
    stubs: int
    start_bytes: int          # stubs x the region's start size
    growth_bytes: int         # the growth of the stubs that pass large tensors
    growing: dict[str, int]   # model -> growth of each of its stubs

    @property
    def total_bytes(self) -> int:
        return self.start_bytes + self.growth_bytes


def row_bytes(tensor) -> int:
    """Bytes per batch row of a config tensor (``ModelInput``/``ModelOutput``)."""
    from tritonclient.grpc import model_config_pb2

    dtype = model_config_pb2.DataType.Name(tensor.data_type)
    return DTYPE_BYTES.get(dtype, 0) * math.prod(max(d, 1) for d in tensor.dims)


def large_batch_bytes(config) -> int:
    """One full batch of ``config``'s large outputs."""
    large = sum(b for b in (row_bytes(t) for t in config.output) if b > LARGE_ROW_BYTES)
    return max(config.max_batch_size, 1) * large


def stub_growth(config, models: dict) -> int:
    """What one stub of ``config`` holds at once beyond small traffic (0 for most)."""
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    if "subrequest_threads" in parameters:
        stage_models = [models[v] for k, v in parameters.items()
                        if k.endswith("_model") and v in models]
        per_response = max((large_batch_bytes(m) for m in stage_models), default=0)
        return int(parameters["subrequest_threads"]) * per_response
    return large_batch_bytes(config)


def budget(repositories: list[Path], region_bytes: int = flags.SHM_DEFAULT_BYTES,
           step_bytes: int = flags.SHM_GROWTH_BYTES) -> Budget:
    """The ``/dev/shm`` a server of ``repositories`` needs, by the rule above."""
    configs = launcher.read_configs(repositories)
    models = {c.name: c for c in configs}
    stubs = launcher.stub_instances(configs)
    growing: dict[str, int] = {}
    growth = 0
    for config in configs:
        if config.backend not in liveness.STUB_BACKENDS:
            continue
        held = stub_growth(config, models)
        if held:
            per_stub = math.ceil(held / step_bytes) * step_bytes
            growing[config.name] = per_stub
            growth += per_stub * launcher.stub_instances([config])
    return Budget(stubs=stubs, start_bytes=stubs * region_bytes, growth_bytes=growth,
                  growing=growing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonlocal.shm",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("repositories", nargs="+", type=Path)
    args = parser.parse_args(argv)
    result = budget(args.repositories)
    print(f"{result.stubs} stubs x {flags.SHM_DEFAULT_BYTES // MIB} MiB = "
          f"{result.start_bytes / MIB:.0f} MiB at start")
    for model, per_stub in sorted(result.growing.items()):
        print(f"  + {model}: {per_stub / MIB:.0f} MiB per stub")
    print(f"/dev/shm needed: {result.total_bytes / MIB:.0f} MiB "
          f"({result.total_bytes / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
