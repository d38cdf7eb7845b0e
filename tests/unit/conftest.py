"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def made():
    """Orchestrators a test made (``bls_models.triton_runtime.Orchestrator`` over a fake
    ``pb_utils``), closed afterwards whatever happened."""
    made: list = []
    yield made
    for orchestrator in made:
        orchestrator.close()
