"""The runtime's size and one request's path, as docs/orchestrator.md states them (issue 40's
counts): the runtime in at most 1 300 lines; a normal request through at most 6 of its modules
and 10 concepts. The path is traced, not read off the docs: one request runs through the
orchestrator over the fake pb_utils with every thread's calls recorded."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "orchestrator.md"
# The contract and pipeline modules, not counted as the runtime (issue 40).
NOT_RUNTIME = {"spec", "definition", "pipelines", "cascade", "params", "repository", "errors"}
MAX_LINES, MAX_MODULES, MAX_CONCEPTS = 1300, 6, 10


def runtime_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "bls_models").glob("*.py") if p.stem not in NOT_RUNTIME)


def section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_runtime_is_at_most_1300_lines_and_the_page_says_how_many():
    lines = sum(len(p.read_text().splitlines()) for p in runtime_modules())
    assert lines <= MAX_LINES, f"the runtime is {lines} lines"
    assert f"{lines:,}".replace(",", " ") in section("One request from `execute` to its answer"), \
        f"docs/orchestrator.md does not state the runtime's {lines} lines"


def traced_modules() -> set[str]:
    """The bls_models modules whose code runs, on any thread, for one normal `pipeline`
    request (its sub-models in-process, answering at once)."""
    from tests.helpers import image_inputs, orchestrator, sub_models
    from tests.unit.fake_pb_utils import FakePbUtils, Request

    pb = FakePbUtils(sub_models())
    orch = orchestrator(pb)
    pb.execute(orch, [Request(image_inputs())])  # warm: threads started, caches filled
    seen: set[str] = set()

    def profile(frame, event, arg):
        name = frame.f_globals.get("__name__", "")
        if name.startswith("bls_models."):
            seen.add(name.split(".", 1)[1])

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        request = Request(image_inputs(), request_id="traced")
        pb.execute(orch, [request])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert not request.answer.has_error()
    pb.finalize(orch)
    return seen


def test_one_normal_request_passes_through_the_modules_the_page_lists():
    traced = traced_modules() - NOT_RUNTIME
    assert len(traced) <= MAX_MODULES, sorted(traced)
    text = section("One request from `execute` to its answer")
    listed = set(re.findall(r"`bls_models/(\w+)\.py`", text.split("Concepts", 1)[0]))
    assert traced <= listed, f"traced {sorted(traced)}, the page lists {sorted(listed)}"
    assert len(listed - NOT_RUNTIME) <= MAX_MODULES


def test_the_page_names_at_most_ten_concepts_on_that_path():
    text = section("One request from `execute` to its answer").split("Concepts", 1)[1]
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    concepts = rows[1:]  # the first is the header
    assert 0 < len(concepts) <= MAX_CONCEPTS, concepts


def test_each_mechanism_in_the_ledger_names_a_test_that_exists():
    """Every row of the ledger names a test (``file::name``) that this suite has."""
    text = section("The ledger: every mechanism, what it prevents, what it costs")
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert named, "the ledger names no test"
    for path, name in named:
        source = (ROOT / path).read_text()
        assert re.search(rf"def {name}\b", source), f"{path}::{name} does not exist"
    assert np.unique([p for p, _ in named]).size >= 3
