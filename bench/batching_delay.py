"""How the orchestrator's own dynamic batcher shapes its groups over fast sub-models.

``python -m bench.batching_delay 0 2000:8 0/subrequest_threads=4 0/instances=4`` serves the
``overhead`` experiment's repository (the committed configs over ONNX models of size ``fast``, or
with ``--models committed`` the repository's own, in a temporary directory) once per variant —
``<max_queue_delay_microseconds>[:<preferred_batch_size>][/<parameter>=<value>]...`` set on
``pipeline``'s dynamic batcher and parameters (``instances``: its instance count) — and prints,
for ``pipeline`` and ``pipeline_ensemble``: req/s and CPU per request of the stubs and of
tritonserver at concurrency 16 (perf_analyzer over gRPC, 8 s accounted), requests per
``execute`` (Triton's successful requests / ``execution_count``), and the p50 at concurrency 1.
The repository given (default ``model_repository/``) is only read.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from bench import overhead, profile
from bench.perf import p50_at_1
from tritonlocal import TritonServer, on_free_ports

ROOT = Path(__file__).resolve().parents[1]


def batching(config: str, delay_us: int, preferred: int | None,
             settings: dict[str, str] | None = None) -> str:
    """``config`` with the dynamic batcher's delay (and preferred size) and ``settings``:
    orchestrator parameters, and ``instances`` (the instance count)."""
    lines = [f"  max_queue_delay_microseconds: {delay_us}"]
    if preferred:
        lines.append(f"  preferred_batch_size: {preferred}")
    config = config.replace("dynamic_batching {\n",
                            "dynamic_batching {\n" + "\n".join(lines) + "\n", 1)
    for key, value in (settings or {}).items():
        if key == "instances":
            config, found = re.subn(r"instance_group \{\n  count: \d+",
                                    f"instance_group {{\n  count: {value}", config, count=1)
        else:
            config, found = re.subn(
                rf'(key: "{re.escape(key)}"\n  value {{\n    string_value: )"[^"]*"',
                rf'\g<1>"{value}"', config, count=1)
            if not found:
                config += (f'parameters {{\n  key: "{key}"\n  value {{\n'
                           f'    string_value: "{value}"\n  }}\n}}\n')
                found = 1
        if not found:
            raise ValueError(f"cannot set {key} in the config")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batching_delay",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="<delay µs>[:<preferred batch size>]")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--models", choices=("fast", "committed"), default="fast",
                        help="the sub-models: size fast (the default), or the repository's own")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batching-delay-") as tmp:
        repository = overhead.fast_repository(Path(tmp) / "model_repository",
                                              args.model_repository, args.models)
        config = repository / "pipeline" / "config.pbtxt"
        committed = config.read_text()
        print("| variant | model | req/s (c=16) | stub CPU ms/req | tritonserver CPU ms/req | "
              "rows per execute | p50 at c=1 (µs) |\n|---|---|---|---|---|---|---|", flush=True)
        for variant in args.variants:
            batcher, *settings = variant.split("/")
            delay, _, preferred = batcher.partition(":")
            config.write_text(batching(committed, int(delay),
                                       int(preferred) if preferred else None,
                                       dict(setting.split("=", 1) for setting in settings)))
            log = Path(tmp) / f"server-{variant.replace('/', '-')}.log"
            with TritonServer(on_free_ports(repository, log)) as server:
                for model in ("pipeline", "pipeline_ensemble"):
                    load = profile.drive(server, model, 16, 8.0, warmup=3.0)
                    cpu = load.cpu_ms_per_request()
                    executions = (load.stats_after[model]["executions"]
                                  - load.stats_before[model]["executions"])
                    rows = load.requests / max(1, executions)
                    print(f"| {variant} | {model} | {load.requests / load.seconds:.0f} | "
                          f"{cpu.get(f'{model} stubs', 0.0):.2f} | "
                          f"{cpu.get('tritonserver', 0.0):.2f} | "
                          f"{rows:.2f} | {p50_at_1(server, model)} |", flush=True)
    return 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
