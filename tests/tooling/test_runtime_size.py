"""The runtime's size and one request's path, as docs/orchestrator.md states them: the runtime in
at most 1 400 lines (1 300 until issue 47's owed answers); a normal request through at most 6 of
its modules and 12 concepts. The path is traced, not read off the docs: one `pipeline` request
enters the model through Triton's own entry points (``python_model``'s class: ``initialize``,
``execute``) over the fake pb_utils, under the committed (CPU) configs and the GPU profile, with
every thread's calls recorded.

A concept is a top-level class or public function of a ``bls_models`` module whose code the
request runs (a method counts as its class; a private helper, ``_name``, as part of its module's
public names), and the pipeline's own module as one: its run function and what it calls."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "orchestrator.md"
# The contract and pipeline modules, not counted as the runtime (issue 40).
NOT_RUNTIME = {"spec", "definition", "pipelines", "cascade", "params", "repository", "errors"}
MAX_LINES, MAX_MODULES, MAX_CONCEPTS = 1400, 6, 12
PIPELINE_MODULE = "pipelines"  # where `pipeline`'s run function lives


def runtime_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "bls_models").glob("*.py") if p.stem not in NOT_RUNTIME)


def section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_runtime_is_at_most_1400_lines_and_the_page_says_how_many():
    lines = sum(len(p.read_text().splitlines()) for p in runtime_modules())
    assert lines <= MAX_LINES, f"the runtime is {lines} lines"
    assert f"{lines:,}".replace(",", " ") in section("One request from `execute` to its answer"), \
        f"docs/orchestrator.md does not state the runtime's {lines} lines"


def traced(profile: str) -> set[tuple[str, str]]:
    """(module, top-level name) of the code one normal `pipeline` request runs, on any thread,
    entering through ``python_model("pipeline")`` as Triton does (no warm-up: the pool's threads
    start inside the trace, so their code is seen)."""
    from bls_models.triton_runtime import python_model
    from tests import helpers
    from tests.unit.fake_pb_utils import FakePbUtils, Request

    pb = FakePbUtils(helpers.sub_models())
    directory = helpers.REPOSITORY
    if profile != "cpu":
        directory = helpers.rendered_repository(profile)
        pb.gpu = frozenset(helpers.gpu_models(directory))
    config = helpers.committed_config("pipeline", directory)
    sys.modules["triton_python_backend_utils"] = pb
    try:
        model = python_model("pipeline")()
        model.initialize({"model_name": "pipeline", "model_config": json.dumps(config),
                          "model_repository": str(directory / "pipeline")})
    finally:
        del sys.modules["triton_python_backend_utils"]
    seen: set[tuple[str, str]] = set()

    def profile_call(frame, event, arg):
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("bls_models."):
            seen.add((name.split(".", 1)[1], frame.f_code.co_qualname.split(".")[0]))

    threading.setprofile(profile_call)
    sys.setprofile(profile_call)
    try:
        request = Request(helpers.image_inputs(), request_id="traced")
        pb.execute(model, [request])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert not request.answer.has_error(), request.answer.error().message()
    pb.finalize(model)
    assert pb.check() == []
    return seen


def concepts(seen: set[tuple[str, str]]) -> set[str]:
    """The concepts of a trace, as the module docstring counts them."""
    return {module if module == PIPELINE_MODULE else f"{module}.{name}"
            for module, name in seen if module == PIPELINE_MODULE or not name.startswith("_")}


@pytest.fixture(scope="module")
def paths() -> dict[str, set[tuple[str, str]]]:
    return {profile: traced(profile) for profile in ("cpu", "gpu")}


def test_one_normal_request_passes_through_the_modules_the_page_lists(paths):
    text = section("One request from `execute` to its answer")
    listed = set(re.findall(r"`bls_models/(\w+)\.py`", text.split("Concepts", 1)[0]))
    for profile, seen in paths.items():
        modules = {module for module, _ in seen} - NOT_RUNTIME
        assert len(modules) <= MAX_MODULES, (profile, sorted(modules))
        assert modules <= listed, f"{profile}: traced {sorted(modules)}, listed {sorted(listed)}"
    assert len(listed - NOT_RUNTIME) <= MAX_MODULES


def table_concepts() -> list[str]:
    """The concepts docs/orchestrator.md's table names: each row's first `module.Name`."""
    text = section("One request from `execute` to its answer").split("Concepts", 1)[1]
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return [re.search(r"`([\w.]+)`", row.split("|")[2]).group(1) for row in rows[1:]]


def test_the_page_names_exactly_the_traced_concepts_at_most_twelve(paths):
    cpu, gpu = concepts(paths["cpu"]), concepts(paths["gpu"])
    assert len(cpu) <= MAX_CONCEPTS and len(gpu) <= MAX_CONCEPTS, (sorted(cpu), sorted(gpu))
    assert "backend.DeviceTensor" in gpu - cpu  # the GPU profile's kept PIXELS
    named = table_concepts()
    assert len(named) == len(set(named)), named
    assert set(named) == cpu | gpu, f"the page names {sorted(named)}, the trace {sorted(cpu | gpu)}"
    text = section("One request from `execute` to its answer")
    assert f"{len(cpu)} concepts" in text and f"{len(gpu)} under the GPU profile" in text


def test_each_mechanism_in_the_ledger_names_a_test_that_exists():
    """Every row of the ledger names a test (``file::name``) that this suite has."""
    text = section("The ledger: every mechanism, what it prevents, what it costs")
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert named, "the ledger names no test"
    for path, name in named:
        source = (ROOT / path).read_text()
        assert re.search(rf"def {name}\b", source), f"{path}::{name} does not exist"
    assert np.unique([p for p, _ in named]).size >= 3
