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
        fake = orchestrator.backend.pb
        if hasattr(fake, "finalize"):
            fake.finalize(orchestrator)
        else:
            orchestrator.close()
    for orchestrator in made:
        fake = orchestrator.backend.pb
        assert getattr(fake, "violations", []) == [], fake.violations


@pytest.fixture
def long_hold(monkeypatch):
    """``execute`` waits for its batch up to ``return_within_ms`` (1 s as committed), whatever
    the recent batches took: tests of the normal path that must not depend on how busy the host
    is (params.HOLD_FLOOR_MS, FIRST_HOLD_MS)."""
    from bls_models import params

    monkeypatch.setattr(params, "HOLD_FLOOR_MS", 60_000)
    monkeypatch.setattr(params, "FIRST_HOLD_MS", 60_000)
