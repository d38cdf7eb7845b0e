"""The BLS models' ``config.pbtxt`` parameters: declared once, parsed and checked in ``initialize``.

Operators configure the orchestrators, they do not edit code: which model each stage calls, the
per-stage timeouts, the default deadline and the concurrency limits are all ``parameters``.
Every parameter is declared here (the common ones, each stage's) or in its pipeline's definition
(``PipelineDef.parameters``), with its default: the one place defaults live. A key the pipeline
does not accept is an error (a typo, or a setting that would do nothing, must not be ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """The model's configuration is unusable; the model must fail to load with this message."""


@dataclass(frozen=True)
class Param:
    """One accepted parameter: an integer (``minimum`` set), one of ``choices``, or a string."""

    name: str
    default: str       # as written in config.pbtxt
    meaning: str
    minimum: int | None = None
    choices: tuple[str, ...] = ()
    maximum: int | None = None
    listed: bool = True  # written into the generated config.pbtxt (operators tune it there)

    def value(self, raw: str | None, problems: list[str]):
        """The parsed value of ``raw`` (None or "": the default), or the default and a problem."""
        text = self.default if raw in (None, "") else raw
        if self.choices:
            if text not in self.choices:
                problems.append(f"parameter '{self.name}' must be one of "
                                f"{', '.join(self.choices)}, got '{text}'")
                return self.default
            return text
        if self.minimum is None:
            return text
        try:
            number = int(text)
        except ValueError:
            problems.append(f"parameter '{self.name}' must be an integer, got '{text}'")
            return int(self.default)
        if number < self.minimum:
            problems.append(f"parameter '{self.name}' must be >= {self.minimum}, got {number}")
        elif self.maximum is not None and number > self.maximum:
            problems.append(f"parameter '{self.name}' must be <= {self.maximum}, got {number}")
        return number


@dataclass(frozen=True)
class RealParam(Param):
    """A parameter that is a finite real number (at least ``minimum`` when set), e.g. a
    probability threshold."""

    def value(self, raw: str | None, problems: list[str]):
        text = self.default if raw in (None, "") else raw
        try:
            number = float(text)
        except ValueError:
            number = float("nan")
        if number != number or number in (float("inf"), float("-inf")):
            problems.append(f"parameter '{self.name}' must be a number, got '{text}'")
            return float(self.default)
        if self.minimum is not None and number < self.minimum:
            problems.append(f"parameter '{self.name}' must be >= {self.minimum}, got {text}")
        return number


DEFAULT_DEADLINE = Param("default_deadline_ms", "10000",
                         "end-to-end budget when the client sets no timeout", minimum=1)
MAX_DEADLINE = Param(
    "max_deadline_ms", "120000",
    "the longest a request may run: a client timeout above it is cut to it (answered "
    "UNAVAILABLE by then). The supervisor reads it too: it stops a replaced copy's stubs only "
    "once this much has passed since the switch, when no request they hold can still be within "
    "its deadline ([reliability.md](reliability.md#a-stub-killed-under-load))", minimum=1)
SUBREQUEST_THREADS = Param(
    "subrequest_threads", "16",
    "threads per instance that run its groups and their sub-requests: the most sub-requests out "
    "at once, abandoned ones (past their deadline, still running) included; a group that finds "
    "none free is answered UNAVAILABLE. Must stay below the python backend's `thread-pool-size` "
    "(96 as launched)", minimum=1)
MAX_OWED_ANSWERS = Param(
    "max_owed_answers", "4",
    "requests per instance that may be answered after `execute` returned: a batch running "
    "longer than 100 ms frees its instance if those still running fit, so a slow request holds "
    "up no one; a stub killed meanwhile never answers them (their clients wait for their own "
    "deadline). 0: every answer before `execute` returns "
    "([orchestrator.md](orchestrator.md#owed-answers))", minimum=0)
STAGE_MODEL_REPOSITORIES = Param(
    "stage_model_repositories", "",
    "more repositories (comma-separated paths) in which the load-time check looks for stage "
    "models, for servers started with several `--model-repository`", listed=False)
GPU_TENSORS = Param(
    "gpu_tensors", "off",
    "`on`: outputs that only flow into later stages stay in GPU memory and go to the next stages "
    "by DLPack, for stages whose model is configured KIND_GPU; others are copied as with `off` "
    "([production.md](production.md#gpu-tensors-between-stages-gpu_tensors)); accepted only by "
    "pipelines with such outputs. `always` (tests): kept by DLPack wherever they are, host "
    "memory too, so a CPU server runs the GPU path", choices=("off", "on", "always"),
    listed=False)

COMMON: tuple[Param, ...] = (DEFAULT_DEADLINE, MAX_DEADLINE, SUBREQUEST_THREADS, MAX_OWED_ANSWERS,
                             STAGE_MODEL_REPOSITORIES, GPU_TENSORS)


def stage_parameters(stage: str, default_model: str) -> tuple[Param, Param]:
    return (Param(f"{stage}_model", default_model, "the model the stage calls"),
            Param(f"{stage}_timeout_ms", "0",
                  "cap on one sub-request of the stage, ms; 0 = the deadline only", minimum=0))


@dataclass(frozen=True)
class Stage:
    name: str          # the stage, e.g. "classifier"
    model: str         # the sub-model it calls, from `<stage>_model`
    timeout_ms: int    # `<stage>_timeout_ms`: cap on this stage's sub-request; 0 = deadline only


@dataclass(frozen=True)
class OrchestratorConfig:
    """The parsed parameters (their defaults are the ``Param``s above)."""

    stages: dict[str, Stage]
    default_deadline_ms: int
    max_deadline_ms: int         # a client's timeout is cut to it; the supervisor waits it out
    subrequest_threads: int      # per instance: threads running groups and their sub-requests
    max_owed_answers: int        # per instance: requests answered after their execute returned
    # More model repositories in which to find the stage models' configs at load time, for
    # servers started with several --model-repository flags.
    stage_model_repositories: tuple[str, ...]
    # Pass-through outputs stay where the sub-model put them (its GPU) and go to the next stage
    # by DLPack, for stages whose model is KIND_GPU; otherwise every output is copied to the CPU.
    gpu_tensors: str  # off, on, always
    # The pipeline's own parameters (PipelineDef.parameters), parsed.
    options: dict[str, object] = field(default_factory=dict)

    def stage(self, name: str) -> Stage:
        return self.stages[name]


_COMMON_NAMES = {p.name for p in COMMON}


# Parameters the serving side adds to a config and the orchestrator ignores: the supervisor's
# in-process reload (tritonlocal.reload.reload_model) marks the config it loads with
# "tritonlocal.reload", the one change that makes Triton replace every instance of a model.
RESERVED_PREFIX = "tritonlocal."


def string_parameters(model_config: dict) -> dict[str, str]:
    """``{"key": {"string_value": "v"}}`` from a model config dict, as ``{"key": "v"}``, without
    the RESERVED_PREFIX keys."""
    return {k: str(v.get("string_value", "")) for k, v in (model_config.get("parameters") or {}).items()
            if not k.startswith(RESERVED_PREFIX)}


def parse(values: dict[str, str], accepted: tuple[Param, ...], stages: list[str]
          ) -> OrchestratorConfig:
    """Parse ``values`` against the ``accepted`` parameters of an orchestrator with ``stages``.

    Raises ConfigError naming every problem at once.
    """
    problems: list[str] = []
    known = {p.name: p for p in accepted}
    for key in sorted(set(values) - set(known)):
        problems.append(f"unknown parameter '{key}' (accepted: {', '.join(sorted(known))})")
    parsed = {name: p.value(values.get(name), problems) for name, p in known.items()}
    stage_names = {f"{s}_{what}" for s in stages for what in ("model", "timeout_ms")}
    config = OrchestratorConfig(
        stages={s: Stage(s, parsed[f"{s}_model"], parsed[f"{s}_timeout_ms"]) for s in stages},
        default_deadline_ms=parsed["default_deadline_ms"],
        max_deadline_ms=parsed["max_deadline_ms"],
        subrequest_threads=parsed["subrequest_threads"],
        max_owed_answers=parsed["max_owed_answers"],
        stage_model_repositories=tuple(
            p.strip() for p in parsed["stage_model_repositories"].split(",") if p.strip()),
        gpu_tensors=parsed.get("gpu_tensors", GPU_TENSORS.default),
        options={name: value for name, value in parsed.items()
                 if name not in _COMMON_NAMES | stage_names},
    )
    if config.default_deadline_ms > config.max_deadline_ms:
        problems.append(f"default_deadline_ms ({config.default_deadline_ms}) is above "
                        f"max_deadline_ms ({config.max_deadline_ms})")
    if problems:
        raise ConfigError("; ".join(problems))
    return config
