"""The README's Python example, run as written against the test server (only its address
changed): a long document through ``tag_pipeline``, digits through ``digits_cascade``."""

from __future__ import annotations

import contextlib
import io

import numpy as np

from tests.helpers import ROOT

MARKER = "<!-- readme: control-flow example -->\n```python\n"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "README.md lost its control-flow example"
    return text.split(MARKER, 1)[1].split("\n```\n", 1)[0] + "\n"


def test_the_readmes_python_example_runs_as_written(server):
    code = readme_example()
    assert '"127.0.0.1:8001"' in code
    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace('"127.0.0.1:8001"', repr(server.grpc_url)), "README.md",
                     "exec"), scope)
    lines = printed.getvalue().splitlines()
    assert lines[0] == "(1, 3000)", lines
    assert scope["tags"].shape == (1, 3000) and scope["tags"].dtype == np.int64
    digits = scope["answer"].as_numpy("DIGIT")[:, 0]
    # load_digits' first eight images are the digits 0 to 7, which both models know.
    np.testing.assert_array_equal(digits, np.arange(8))
