"""Sub-response outputs and request inputs: used as they are when the stub owns their memory (the
python backend's own copies), copied when they borrow a buffer that dies with the response or
the request (``Backend.owns_memory``)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from bls_models import spec as S
from bls_models.backend import Backend
from tests.helpers import image_inputs, orchestrator, sub_models
from tests.unit.fake_pb_utils import FakePbUtils, Request

owns_memory = Backend.owns_memory

# Under the committed (CPU) configs and the GPU profile: tests/unit/conftest.py.
pytestmark = pytest.mark.usefixtures("profile")


def test_numpy_allocations_and_views_of_them_are_owned():
    array = np.arange(12, dtype=np.float32)
    assert owns_memory(array)
    assert owns_memory(array.reshape(3, 4)[1:])
    assert owns_memory(array.view(np.int32))      # what PbTensor returns: a view of its copy


def test_arrays_over_foreign_buffers_are_not_owned():
    raw = bytearray(48)
    assert not owns_memory(np.frombuffer(raw, np.float32))
    assert not owns_memory(np.frombuffer(raw, np.float32).reshape(3, 4)[1:])
    with mmap.mmap(-1, 4096) as shared:                # like a response's shared memory
        view = np.frombuffer(shared, np.uint8)
        assert not owns_memory(view)
        del view


def _embedder_answers(owned: bool):
    """A pipeline whose embedder answers with an array over a scratch buffer it reuses (the
    python backend's shared memory after the response is gone), or with its own array."""
    models = sub_models()
    scratch = bytearray(4 * S.EMBEDDING_DIM * 4)
    handed_out = []

    def embedder(inputs, request):
        batch = next(iter(inputs.values())).shape[0]
        values = np.full((batch, S.EMBEDDING_DIM), len(handed_out) + 1, np.float32)
        if owned:
            out = values
        else:
            out = np.frombuffer(scratch, np.float32, count=values.size).reshape(values.shape)
            out[...] = values
        handed_out.append(out)
        return {S.EMBEDDING.name: out}

    models[S.EMBEDDER.name] = embedder
    return models, scratch, handed_out


def _answered_embedding(made, models, request_id: str) -> np.ndarray:
    pb = FakePbUtils(models)
    made.append(orch := orchestrator(pb))
    request = Request(image_inputs(1), request_id=request_id)
    pb.execute(orch, [request])  # answered before it returns
    (response,) = request.answers
    return next(t for t in response.output_tensors if t.name() == S.EMBEDDING.name).as_numpy()


def test_an_output_borrowing_the_responses_memory_is_copied_before_the_response_goes(made):
    models, scratch, handed_out = _embedder_answers(owned=False)
    embedding = _answered_embedding(made, models, "borrowed")
    scratch[:] = bytes(len(scratch))   # the shared memory is reused once the response is gone
    assert (embedding == 1).all()
    assert not np.shares_memory(embedding, handed_out[0])


def test_an_output_the_stub_owns_is_not_copied_again(made):
    models, _, handed_out = _embedder_answers(owned=True)
    embedding = _answered_embedding(made, models, "owned")
    assert (embedding == 1).all()
    assert np.shares_memory(embedding, handed_out[0])
