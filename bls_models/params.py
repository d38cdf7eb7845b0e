"""The BLS models' ``config.pbtxt`` parameters: parsed and checked once, in ``initialize``.

Operators configure the orchestrators, they do not edit code: which model each stage calls, the
per-stage timeouts, the default deadline and the concurrency limits are all ``parameters``.
Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

from dataclasses import dataclass

FANOUTS = ("concurrent", "sequential")
CONCURRENCY_MODES = ("event_loop", "batch_gather")
GPU_TENSORS = ("off", "on")


class ConfigError(ValueError):
    """The model's configuration is unusable; the model must fail to load with this message."""


@dataclass(frozen=True)
class Stage:
    name: str          # the stage, e.g. "classifier"
    model: str         # the sub-model it calls, from `<stage>_model`
    timeout_ms: int    # `<stage>_timeout_ms`: cap on this stage's sub-request; 0 = deadline only


@dataclass(frozen=True)
class OrchestratorConfig:
    stages: dict[str, Stage]
    default_deadline_ms: int
    max_inflight_requests: int   # per instance; beyond it, execute() waits (backpressure)
    subrequest_threads: int      # per instance; sub-requests waiting on a sub-model at once
    fanout: str                  # "concurrent" (production) or "sequential" (benchmark baseline)
    concurrency_mode: str        # "event_loop" (production) or "batch_gather" (measured alternative)
    # More model repositories in which to find the stage models' configs at load time (comma-
    # separated absolute paths), for servers started with several --model-repository flags.
    stage_model_repositories: tuple[str, ...] = ()
    # "on": outputs that only flow into other stages (spec.PASS_THROUGH) stay where the sub-model
    # put them, on its GPU, and go to the next stage by DLPack; "off": every output is copied to
    # the orchestrator's CPU memory. "on" keeps the copy for stages whose model is not configured
    # KIND_GPU (a CPU host, the portable repository), so it is safe everywhere.
    gpu_tensors: bool = False

    def stage(self, name: str) -> Stage:
        return self.stages[name]


DEFAULTS = {
    "default_deadline_ms": 10_000,
    "max_inflight_requests": 512,
    "subrequest_threads": 64,
}


def string_parameters(model_config: dict) -> dict[str, str]:
    """``{"key": {"string_value": "v"}}`` from a model config dict, as ``{"key": "v"}``."""
    return {k: str(v.get("string_value", "")) for k, v in (model_config.get("parameters") or {}).items()}


def parse(parameters: dict[str, str], stages: dict[str, str]) -> OrchestratorConfig:
    """Parse the parameters of an orchestrator whose stages (name -> default model) are given.

    Raises ConfigError naming every problem at once.
    """
    problems: list[str] = []
    known = {"fanout", "concurrency_mode", "stage_model_repositories", "gpu_tensors", *DEFAULTS}
    for stage in stages:
        known.update({f"{stage}_model", f"{stage}_timeout_ms"})
    for key in sorted(set(parameters) - known):
        problems.append(f"unknown parameter '{key}' (known: {', '.join(sorted(known))})")

    def integer(key: str, default: int, minimum: int) -> int:
        raw = parameters.get(key, "")
        if raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            problems.append(f"parameter '{key}' must be an integer, got '{raw}'")
            return default
        if value < minimum:
            problems.append(f"parameter '{key}' must be >= {minimum}, got {value}")
        return value

    def choice(key: str, options: tuple[str, ...]) -> str:
        value = parameters.get(key) or options[0]
        if value not in options:
            problems.append(f"parameter '{key}' must be one of {', '.join(options)}, got '{value}'")
        return value

    parsed_stages = {}
    for stage, default_model in stages.items():
        model = parameters.get(f"{stage}_model") or default_model
        parsed_stages[stage] = Stage(stage, model, integer(f"{stage}_timeout_ms", 0, 0))
    config = OrchestratorConfig(
        stages=parsed_stages,
        default_deadline_ms=integer("default_deadline_ms", DEFAULTS["default_deadline_ms"], 1),
        max_inflight_requests=integer("max_inflight_requests", DEFAULTS["max_inflight_requests"], 1),
        subrequest_threads=integer("subrequest_threads", DEFAULTS["subrequest_threads"], 1),
        fanout=choice("fanout", FANOUTS),
        concurrency_mode=choice("concurrency_mode", CONCURRENCY_MODES),
        stage_model_repositories=tuple(
            p.strip() for p in parameters.get("stage_model_repositories", "").split(",") if p.strip()),
        gpu_tensors=choice("gpu_tensors", GPU_TENSORS) == "on",
    )
    if problems:
        raise ConfigError("; ".join(problems))
    return config
