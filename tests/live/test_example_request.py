"""The example request printed by `make serve` (and shown in the README) works as pasted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

from tritonlocal.__main__ import example_request

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_printed_example_request_answers(server):
    command = example_request(server)
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert answer["model_name"] == "pipeline"
    assert outputs["CLASS_IDS"]["shape"] == [1, 5] and outputs["CLASS_PROBS"]["datatype"] == "FP32"
    probs = outputs["CLASS_PROBS"]["data"]
    assert probs == sorted(probs, reverse=True) and 0 < probs[0] <= 1


def test_the_readme_shows_the_same_request_for_the_default_ports():
    default = example_request(SimpleNamespace(http_url="127.0.0.1:8000"))
    assert default in README.read_text()
