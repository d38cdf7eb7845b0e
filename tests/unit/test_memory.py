"""Nothing a request leaves behind waits for Python's cycle collector.

Under a steady share of poisoned requests the orchestrator's stubs grew by about 1.7 GB per
10 000 requests (`python -m reliability.poison_load`, before the fix): each failed group's sub-request
arrays (megabytes: PIXELS of 16 rows is 9.6 MB) sat in reference cycles — an exception whose
traceback holds a frame that holds the exception, a batch and its groups holding each other —
which only the cyclic garbage collector frees, and its full collections are rare. With a
collection after every ``execute`` the same load stayed flat, which located the cause. So the
runtime must leave no cycles: this test runs every path (success, isolation, a deadline, a bug,
a sick stage) with the collector off and finds nothing of bls_models among what it would have to
collect.
"""

from __future__ import annotations

import collections
import gc

import pytest

from tests.helpers import orchestrator
from tests.unit.fake_pb_utils import FakePbUtils, Request
from tests.unit.row_models import POISON, STAGE_ERROR, DirectedRowModels, image_of

# Under the committed (CPU) configs and the GPU profile: tests/unit/conftest.py.
pytestmark = pytest.mark.usefixtures("profile")


def garbage_of_bls_models(work) -> collections.Counter:
    """What of bls_models (objects, and frames of its code) ``work()`` leaves in cycles."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        work()
        gc.collect()
        found = collections.Counter()
        for thing in gc.garbage:
            if type(thing).__module__.startswith("bls_models"):
                found[type(thing).__name__] += 1
            elif type(thing).__name__ == "frame" and "bls_models" in thing.f_code.co_filename:
                found[f"frame {thing.f_code.co_name}"] += 1
        return found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_no_path_leaves_reference_cycles(made):
    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    made.append(orch := orchestrator(pb))
    sick = FakePbUtils(DirectedRowModels(sick={"classifier": STAGE_ERROR}).models())
    made.append(sick_orch := orchestrator(sick))
    pipeline = orch.run

    async def buggy(inputs, call, setup):
        if (inputs["IMAGE"] == 9).all(axis=(1, 2, 3)).any():
            raise ZeroDivisionError("a bug")
        return await pipeline(inputs, call, setup)

    def work():
        for i in range(3):
            pb.execute(orch, [Request(image_of(v), request_id=f"ok{i}-{v}") for v in (20, 21)])
            pb.execute(orch, [Request(image_of(v), request_id=f"bad{i}-{v}")
                              for v in (20, POISON, 22, 23)])
            pb.execute(orch, [Request(image_of(24), request_id=f"late{i};embedder=300",
                                      timeout_us=50_000)])
            sick.execute(sick_orch, [Request(image_of(25), request_id=f"sick{i}")])
        orch.run = buggy
        pb.execute(orch, [Request(image_of(v), request_id=f"bug-{v}") for v in (9, 26)])
        orch.run = pipeline

    found = garbage_of_bls_models(work)
    assert found == collections.Counter(), f"left in reference cycles: {dict(found)}"
