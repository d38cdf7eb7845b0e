"""`python -m tests.ledger` (`make bench-ledger`): what each runtime mechanism costs a normal
request, measured in-process (docs/orchestrator.md, "The ledger").

The orchestrator runs `pipeline` over a lean stand-in for pb_utils whose sub-models answer at
once (the unit tests' fake's plain tensors, responses and errors, with none of its accounting):
what is left is the runtime's own Python. Each mechanism on the normal path is then turned
off (replaced by what the plainest per-batch BLS does in its place) and the CPU per request
measured again, rounds interleaved; its cost is the difference. Off the normal path (isolation,
the memo's use, cancellation, the deadline answers) a mechanism costs nothing until it engages:
the trace in tests/tooling/test_runtime_size.py shows which modules a normal request runs. The
two regimes differ only in what each figure is compared with: the anchor's stub CPU per request
on fast sub-models and on the committed CNNs (bench/results/overhead.md, orchestration.md).
Writes ledger.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import numpy as np

from bench.common import output_arguments
from tests.mutations import plain_wait
from tests.unit import fake_pb_utils as fake

ROUNDS = 7
BATCHES = 1500


# -- a lean pb_utils: no accounting, sub-models answer at once -----------------------------------
class _Request:
    def __init__(self, image, request_id):
        self.image, self.id = image, request_id

    def request_id(self):
        return self.id

    def timeout(self):
        return 0

    def requested_output_names(self):
        return []

    def is_cancelled(self):
        return False


class LeanPbUtils:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL, TRITONSERVER_MEMORY_CPU = 1, 0
    TritonError, Tensor, InferenceResponse = fake.TritonError, fake.Tensor, fake.InferenceResponse

    def __init__(self, rows: int = 16):
        pixels = np.zeros((rows, 3, 224, 224), np.float32)
        logits, embedding = np.zeros((rows, 1000), np.float32), np.zeros((rows, 256), np.float32)
        answers = {"preprocess": lambda n: {"PIXELS": pixels[:n]},
                   "classifier": lambda n: {"LOGITS": logits[:n]},
                   "embedder": lambda n: {"EMBEDDING": embedding[:n]}}

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names, **_):
                self.model, self.rows = model_name, len(inputs[0].as_numpy())
                self.outputs = requested_output_names

            def exec(self):
                values = answers[self.model](self.rows)
                return fake.InferenceResponse([fake.Tensor(n, values[n]) for n in self.outputs])

        class Family:
            COUNTER = GAUGE = HISTOGRAM = 0

            def __init__(self, **_):
                pass

            def Metric(self, labels, buckets=None):
                return mock.Mock()

        class Logger:
            log_info = log_error = log_warn = staticmethod(lambda message: None)

        self.InferenceRequest, self.MetricFamily, self.Logger = InferenceRequest, Family, Logger

    @staticmethod
    def PreferredMemory(kind, device):
        return (kind, device)

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return fake.Tensor(name, request.image) if name == "IMAGE" else None

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return next((t for t in response.output_tensors if t.name() == name), None)


# -- the mechanisms, and what the plainest BLS does in their place ------------------------------


def _plain_validate(self, inputs):
    pass


MECHANISMS = {
    "execute's thread keeps its batch's time (deadlines, stage timeouts, cancellation)": {
        "bls_models.triton_runtime.Orchestrator._wait": plain_wait},
    "per-request validation before stacking (non-finite values, the pipeline's check)": {
        "bls_models.triton_runtime.Orchestrator._validate": _plain_validate},
    "the gate: a sub-request made only if wanted, with the time left": {
        "bls_models.triton_runtime.Orchestrator._admit": lambda self, group, stage, token:
            1_000_000},
    "outputs checked finite before the answer is built": {
        "bls_models.triton_runtime.Orchestrator._non_finite": lambda self, arrays: None},
    "metrics kept in the stub (requests, stages, rows)": {
        "bls_models.metrics.Metrics.record": lambda self, increments=(), observations=(): None},
}


def orchestrator(rows: int):
    from google.protobuf import json_format

    from bls_models import repository
    from bls_models.triton_runtime import Orchestrator

    root = Path(__file__).resolve().parents[1] / "model_repository" / "pipeline"
    config = json_format.MessageToDict(repository.load_config(root / "config.pbtxt"),
                                       preserving_proto_field_name=True)  # as shipped
    return Orchestrator(LeanPbUtils(rows), {"model_name": "pipeline",
                                            "model_config": json.dumps(config),
                                            "model_repository": str(root)}, "pipeline")


def cpu_per_request_us(orch, rows: int, batches: int) -> float:
    image = np.zeros((1, 224, 224, 3), np.uint8)
    work = [[_Request(image, f"r{i}-{k}") for k in range(rows)] for i in range(batches)]
    started = time.process_time()
    for requests in work:
        orch.execute(requests)
    return (time.process_time() - started) / (batches * rows) * 1e6


def measure(rows: int, rounds: int, batches: int) -> dict[str, list[float]]:
    """Per variant (the runtime, and it without each mechanism), CPU per request in µs, one
    value per round."""
    orch = orchestrator(rows)
    cpu_per_request_us(orch, rows, 200)  # warm
    out: dict[str, list[float]] = {"runtime": [], **{name: [] for name in MECHANISMS}}
    for index in range(rounds):
        order = ["runtime", *MECHANISMS]
        for variant in order if index % 2 == 0 else order[::-1]:
            with ExitStack() as stack:
                for target, replacement in MECHANISMS.get(variant, {}).items():
                    stack.enter_context(mock.patch(target, replacement))
                out[variant].append(cpu_per_request_us(orch, rows, batches))
    orch.close()
    return out


def mutations(out: Path) -> list[str]:
    """Each mechanism of tests/mutations.py turned off, its named tests run: whether they fail
    (they must). Writes ledger-mutations.json; returns the report's lines."""
    import os
    import subprocess

    from tests.mutations import MUTATIONS

    root = Path(__file__).resolve().parents[1]
    lines = ["", "Each mechanism turned off (`tests/mutations.py`), the tests the ledger names "
                 "run alone (`-p tests.mutations`):", "",
             "| mechanism turned off | tests | without it |", "|---|---|---|"]
    found = {}
    for name, (what, tests, _) in MUTATIONS.items():
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                              "-p", "tests.mutations", "-x", *tests], cwd=root,
                             env={**os.environ, "BLS_MUTATION": name},
                             capture_output=True, text=True)
        failed = run.returncode != 0
        found[name] = {"what": what, "tests": tests, "failed": failed,
                       "tail": run.stdout.strip().splitlines()[-1:]}
        lines.append(f"| {what} (`{name}`) | " + ", ".join(f"`{t}`" for t in tests)
                     + f" | {'fails' if failed else '**passes**'} |")
        print(lines[-1], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger-mutations.json").write_text(json.dumps(found, indent=1) + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.ledger",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--batches", type=int, default=BATCHES)
    parser.add_argument("--mutations", action="store_true",
                        help="only check that each mechanism's named tests fail without it")
    output_arguments(parser, "unused")
    args = parser.parse_args(argv)
    if args.mutations:
        lines = mutations(args.out)
        (args.out / "ledger-mutations.md").write_text("\n".join(lines) + "\n")
        return 0
    command = "python -m tests.ledger " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {}
    lines = ["# What each runtime mechanism costs a normal request", "",
             f"`{command.strip()}` — {time.strftime('%Y-%m-%d %H:%M')}: CPU per request of the "
             "runtime's own Python (sub-models answer at once), median of "
             f"{args.rounds} interleaved rounds of {args.batches} batches; a mechanism's cost "
             "is the runtime's figure minus the figure without it.", "",
             "| mechanism | rows per batch | cost, µs per request (range) |", "|---|---|---|"]
    for rows in (1, 8):
        figures = measure(rows, args.rounds, args.batches)
        base = statistics.median(figures["runtime"])
        results[rows] = {"runtime_us": base, "rounds": figures}
        lines.append(f"| the runtime in all | {rows} | {base:.1f} |")
        for name in MECHANISMS:
            costs = [a - b for a, b in zip(figures["runtime"], figures[name])]
            results[rows][name] = statistics.median(costs)
            lines.append(f"| {name} | {rows} | {statistics.median(costs):.1f} "
                         f"({min(costs):.1f}–{max(costs):.1f}) |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ledger.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "ledger.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
