"""The benchmark's experiments by name: ``EXPERIMENTS`` is what `python -m bench --experiment NAME`
(`make bench-NAME`) runs. Each takes a ``Context`` and returns a ``Result`` (bench/common.py);
each lives in the module of its family.

``Context``, ``Result``, ``build_variants`` and ``build_test_repository`` are importable from
here too, as the scripts and tests import them.
"""

from __future__ import annotations

from bench import control_flow, orchestration, ort_options, overhead, saturation
from bench.common import Context, Result
from bench.repository import build_test_repository, build_variants

__all__ = ["EXPERIMENTS", "Context", "Result", "build_test_repository", "build_variants"]

EXPERIMENTS = {
    "orchestration": orchestration.orchestration,
    "overload": saturation.overload,
    "ort_options": ort_options.ort_options,
    "overhead": overhead.overhead,
    "control_flow": control_flow.control_flow,
}
