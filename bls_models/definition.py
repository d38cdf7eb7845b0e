"""The vocabulary of the repository's contracts, and of a BLS pipeline's one definition.

``TensorSpec``, ``BatchingSpec`` and ``ModelSpec`` describe a model the way its ``config.pbtxt``
does. A ``PipelineDef`` describes a BLS orchestrator completely: its tensors, its stages (each
with the sub-model contracts it accepts, the default model's first, and the outputs that only
flow into later stages), the parameters it accepts with their defaults, and the function that
computes it. Everything else is derived from it: the orchestrator's ``ModelSpec`` (so its
generated ``config.pbtxt``), the parameter check at load, the load-time stage-model check, the
metrics' label series and the parameter table in docs/orchestrator.md. docs/extending.md shows
how to add one.

Pure Python: no Triton, no numpy (the run function is resolved only when a server loads it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Callable

from bls_models import params


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton model-config dtype, e.g. "TYPE_FP32"
    dims: tuple[int, ...]


@dataclass(frozen=True)
class BatchingSpec:
    """Dynamic batching and queue policy of one model.

    No queue policy by default: with one, Triton 2.51's batcher stops prefetching and can sleep
    500 ms while instances are idle (docs/configuration.md, "No queue policy"). Where a test sets
    one, ``queue_timeout_us`` is its ``default_timeout_microseconds`` (a per-request timeout, the
    BLS ``timeout``, can only lower it: ``allow_timeout_override``) and ``max_queue_size`` bounds
    the queue: beyond it requests are rejected at once.
    """

    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    queue_timeout_us: int = 0
    max_queue_size: int = 0


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    input_map: dict[str, str]   # the step model's input name -> ensemble tensor name
    output_map: dict[str, str]  # the step model's output name -> ensemble tensor name


@dataclass(frozen=True)
class ModelSpec:
    name: str
    backend: str  # "onnxruntime", "python", or "" for an ensemble (see `platform`)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    batching: BatchingSpec | None  # None: no dynamic batcher (ensembles)
    # Instances per device (KIND_AUTO: one group of `instance_count` on each GPU in the container,
    # CPU instances locally). At least 2 wherever a queue policy is set: with a single instance
    # the dynamic batcher's policy queue stalled in ~500 ms steps under bursts (measured).
    instance_count: int = 2
    # Only where a kind is required: the BLS orchestrators are KIND_CPU (they compute nothing on
    # a GPU, so their instance count must not multiply with the number of GPUs).
    kind: str | None = None
    platform: str = ""
    decoupled: bool = False  # model_transaction_policy (only the measured alternative uses it)
    parameters: dict[str, str] = field(default_factory=dict)
    ensemble_steps: tuple[EnsembleStep, ...] = ()
    description: str = ""
    # For a BLS orchestrator: the registered pipeline it runs (its model.py names it). Variants
    # made with dataclasses.replace keep it.
    orchestrates: str = ""

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name, self.name)

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name, self.name)


def _by_name(tensors: tuple[TensorSpec, ...], name: str, model: str) -> TensorSpec:
    for tensor in tensors:
        if tensor.name == name:
            return tensor
    raise KeyError(f"model '{model}' has no tensor '{name}'")


# No queue policy (see BatchingSpec); a slow batch frees its instance (max_owed_answers), so
# requests wait here only while every instance is busy (docs/orchestrator.md, "Overload").
BLS_BATCHING = BatchingSpec(preferred_batch_sizes=(), max_queue_delay_us=0)
# The queue policy the BLS models had until issue 47, for tests of Triton's queue errors.
QUEUED_BLS_BATCHING = BatchingSpec(preferred_batch_sizes=(), max_queue_delay_us=0,
                                   queue_timeout_us=30_000_000, max_queue_size=4096)


@dataclass(frozen=True)
class StageDef:
    """One stage: the sub-model contracts its model may meet (the default model's first; which
    one the configured model meets is decided at load) and the outputs that only flow into later
    stages (kept on the GPU with ``gpu_tensors: "on"``)."""

    name: str
    contracts: tuple[ModelSpec, ...]
    pass_through: tuple[str, ...] = ()

    @property
    def default_model(self) -> str:
        return self.contracts[0].name


@dataclass(frozen=True)
class Setup:
    """What a pipeline's run function gets besides its inputs and ``call``: the values of its own
    parameters (``PipelineDef.parameters``), per stage the contract its model meets, the most
    rows each stage's model takes in one sub-request (0: unknown, no limit), and which outputs
    the run's rows asked for (``rows``, ``wants``)."""

    options: dict[str, object] = field(default_factory=dict)
    contracts: dict[str, ModelSpec] = field(default_factory=dict)
    max_rows: dict[str, int] = field(default_factory=dict)
    # Per request of the run, in row order: (its rows, the outputs it asked for). Empty: every
    # row asked for every output.
    asked: tuple[tuple[int, frozenset[str]], ...] = ()

    def rows(self, *outputs: str) -> slice | list[int]:
        """The rows that asked for any of ``outputs``: ``slice(None)`` when every row did (so
        ``array[rows]`` is a view), else their indices, in order (empty when none did). Send a
        stage only these rows, and return an output computed from them through
        ``pipelines.scatter``."""
        if not self.asked:
            return slice(None)
        picked: list[int] = []
        start, every = 0, True
        for count, names in self.asked:
            if names.isdisjoint(outputs):
                every = False
            else:
                picked.extend(range(start, start + count))
            start += count
        return slice(None) if every else picked

    def wants(self, *outputs: str) -> bool:
        """Whether any row asked for any of ``outputs``."""
        return not self.asked or any(not names.isdisjoint(outputs) for _, names in self.asked)

    @property
    def total_rows(self) -> int | None:
        """The run's rows, when some asked for less than every output (else None)."""
        return sum(count for count, _ in self.asked) if self.asked else None


# The run function: ``async run(inputs, call, setup) -> outputs``, over numpy arrays whose first
# axis is rows (one run may hold the rows of several requests), reaching sub-models only through
# ``await call(stage, inputs, output_names, reduce=None)`` and running independent ones together
# with ``await gather_all(...)`` (bls_models/pipelines.py). The check: ``check(inputs, setup)``
# over one request's inputs, raising ``errors.InvalidInput`` for bad client data; it runs per request
# before rows are stacked, so a bad request fails alone. Each is given as a callable or as
# "module:function" (resolved at load).
RunFunction = Callable


@dataclass(frozen=True)
class PipelineDef:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    stages: tuple[StageDef, ...]
    run: RunFunction | str
    max_batch_size: int
    check: RunFunction | str | None = None
    # Parameters of this pipeline only (the common ones and each stage's are added).
    parameters: tuple[params.Param, ...] = ()
    # Other defaults for common parameters (name -> value), e.g. fewer sub-request threads.
    defaults: dict[str, str] = field(default_factory=dict)
    description: str = ""
    instance_count: int = 2
    batching: BatchingSpec = BLS_BATCHING
    # Floating-point inputs and outputs that may hold NaN or Inf. Any other FP16/FP32/FP64 input
    # holding one is refused INVALID_ARG, for that request alone, before its rows are stacked;
    # any other output holding one fails the request whose rows it is (INVALID_ARG: its inputs
    # drove the models there), before its answer is built.
    non_finite: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.non_finite) - {t.name for t in (*self.inputs, *self.outputs)}
        if unknown:
            raise ValueError(f"pipeline '{self.name}': non_finite names no input or output "
                             f"{unknown}")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"pipeline '{self.name}': stage names must be unique, got {names}")
        unknown = set(self.defaults) - {p.name for p in params.COMMON}
        if unknown:
            raise ValueError(f"pipeline '{self.name}': defaults for unknown parameters {unknown}")
        final = {t.name for t in self.outputs}
        for stage in self.stages:
            for name in stage.pass_through:
                # It only flows into later stages: never copied out, so never answered.
                if name in final or any(name not in {t.name for t in c.outputs}
                                        for c in stage.contracts):
                    raise ValueError(f"pipeline '{self.name}': pass-through output '{name}' of "
                                     f"stage '{stage.name}' must be an output of every contract "
                                     "of the stage and not one of the pipeline's")

    # -- derived --------------------------------------------------------------------------------
    @property
    def contracts(self) -> dict[str, tuple[ModelSpec, ...]]:
        return {s.name: s.contracts for s in self.stages}

    @property
    def default_models(self) -> dict[str, str]:
        return {s.name: s.default_model for s in self.stages}

    @property
    def pass_through(self) -> dict[str, tuple[str, ...]]:
        return {s.name: s.pass_through for s in self.stages if s.pass_through}

    def accepted(self) -> tuple[params.Param, ...]:
        """Every parameter this pipeline accepts, with its default: the common ones (with this
        pipeline's defaults), each stage's model and timeout, and its own. ``gpu_tensors`` only
        where some stage has pass-through outputs: elsewhere it could do nothing."""
        common = [replace(p, default=self.defaults.get(p.name, p.default)) for p in params.COMMON
                  if p is not params.GPU_TENSORS or self.pass_through]
        stages = [params.stage_parameters(s.name, s.default_model) for s in self.stages]
        return (*(model for model, _ in stages), *(timeout for _, timeout in stages), *common,
                *self.parameters)

    def parse(self, values: dict[str, str]) -> params.OrchestratorConfig:
        """The orchestrator's configuration from its ``config.pbtxt`` parameters; raises
        ``params.ConfigError`` naming every problem (an unknown or unused key is one)."""
        return params.parse(values, self.accepted(), list(self.default_models))

    def model_spec(self) -> ModelSpec:
        """The orchestrator as a model: what ``modelgen.configs`` renders to its config.pbtxt.
        Its parameters list every listed parameter at its default."""
        return ModelSpec(
            name=self.name, backend="python", inputs=self.inputs, outputs=self.outputs,
            max_batch_size=self.max_batch_size, batching=self.batching,
            instance_count=self.instance_count, kind="KIND_CPU",
            parameters={p.name: p.default for p in self.accepted() if p.listed},
            description=self.description, orchestrates=self.name)

    def run_function(self) -> RunFunction:
        return _resolve(self.run)

    def check_function(self) -> RunFunction | None:
        return None if self.check is None else _resolve(self.check)


def _resolve(function: RunFunction | str) -> RunFunction:
    if callable(function):
        return function
    module, _, attribute = function.partition(":")
    return getattr(importlib.import_module(module), attribute)

