"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def made():
    """Orchestrators a test made (``bls_models.triton_runtime.Orchestrator`` over a fake
    ``pb_utils``), finalized afterwards whatever happened; then none of the rules the fake
    checks (tests/unit/fake_pb_utils.py) may have been broken."""
    made: list = []
    yield made
    for orchestrator in made:
        fake = orchestrator.pb
        if hasattr(fake, "finalize"):
            fake.finalize(orchestrator)
        else:
            orchestrator.close()
    for orchestrator in made:
        assert getattr(orchestrator.pb, "violations", []) == [], orchestrator.pb.violations
