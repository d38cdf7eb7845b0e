"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

from tests import helpers
from tests.conftest import MODEL_REPOSITORY


@pytest.fixture(scope="session")
def repository():
    """The project's model repository as committed: the unit tests read its configs and
    ``model.py`` files, never its ONNX files, so they need no export (`make test` runs them while
    the models are still being made)."""
    return MODEL_REPOSITORY


@pytest.fixture(params=helpers.PROFILES)
def profile(request):
    """Run the test under each profile: the committed (CPU) configs, and the GPU profile as
    rendered, where KIND_GPU sub-models answer in GPU memory (``helpers.orchestrator``). A
    module opts in with ``pytestmark = pytest.mark.usefixtures("profile")``."""
    helpers.profile = request.param
    yield request.param
    helpers.profile = "cpu"


@pytest.fixture
def made():
    """Orchestrators a test made (``bls_models.triton_runtime.Orchestrator`` over a fake
    ``pb_utils``), finalized afterwards whatever happened; then none of the rules the fake
    checks may have been broken, the runtime's invariants included (every request answered
    exactly once, before ``execute`` returned and on time; nothing sent for requests already
    answered; each request charged only for its own rows: tests/unit/fake_pb_utils.py)."""
    made: list = []
    yield made
    for orchestrator in made:
        fake = orchestrator.backend.pb
        if hasattr(fake, "finalize"):
            fake.finalize(orchestrator)
        else:
            orchestrator.close()
    for fake in {id(o.backend.pb): o.backend.pb for o in made}.values():
        violations = fake.check() if hasattr(fake, "check") else []
        assert violations == [], violations
