"""After 10 000 requests the orchestrators' stub processes use no more memory than after warm-up.

Two figures per stub, printed (pytest -s) and recorded in docs/orchestrator.md:
- private memory (RssAnon): what a leak grows — a copy of every input kept, responses never
  released. Bound: 32 MiB over the run.
- the python backend's shared-memory region: a pool that grows to the peak of tensors alive at
  once and never shrinks (Triton 2.51). Bounded by a cap derived from that peak, not by zero.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bls_models import spec as S
from tests.live.support import drive, image, memory, stub_pids

PRIVATE_BOUND_MIB = 32


def run(server, model, count, data, name, dtype):
    outcomes = asyncio.run(drive(server.grpc_url, model, count=count, concurrency=32, data=data,
                                 name=name, dtype=dtype, prefix=f"memory-{model}"))
    errors = [e for _, _, e in outcomes if e is not None]
    assert errors == [], f"{len(errors)} errors, e.g. {errors[:2]}"


def measure(server, model, warm_up, requests, data, name, dtype, region_cap_mib, base=None):
    pids = stub_pids(server, model)
    assert len(pids) == S.model(base or model).instance_count
    run(server, model, warm_up, data, name, dtype)
    before = {pid: memory(pid) for pid in pids}
    run(server, model, requests, data, name, dtype)
    after = {pid: memory(pid) for pid in pids}
    print(f"\n{model}: {requests} requests at concurrency 32 after {warm_up} warm-up: " + "; ".join(
        f"private {before[p]['private']:.1f} -> {after[p]['private']:.1f} MiB, "
        f"shm region {before[p]['region']:.0f} -> {after[p]['region']:.0f} MiB" for p in pids))
    for pid in pids:
        assert after[pid]["private"] - before[pid]["private"] < PRIVATE_BOUND_MIB, (pid, before, after)
        assert after[pid]["region"] <= region_cap_mib, (pid, after)


def test_pipeline_stub_memory_is_flat_over_10000_requests(server):
    # Per request in flight: the input image, the sub-requests' IMAGE and 2 x PIXELS, their
    # outputs: about 2 MiB; 32 in flight, twice that for fragmentation, plus the 32 MiB start.
    measure(server, "pipeline", 1_000, 10_000, image(seed=3), "IMAGE", "UINT8",
            region_cap_mib=32 + 2 * 32 * 2)


@pytest.mark.parametrize("model, region_cap_mib", [
    # Over tagger_tags (committed): 8 bytes per token come back; the region never needs to grow
    # past its 32 MiB start.
    ("tag_pipeline", 32),
    # Over the logits tagger: the 28.7 MB-per-sequence logits pass through the orchestrator and
    # none of them may stay. At most 8 tagger responses (subrequest_threads) of 28.7 MB alive at
    # once, twice that for fragmentation, plus the 32 MiB start.
    ("tag_pipeline_logits", 32 + 2 * 8 * 28.7),
])
def test_tag_pipeline_stub_memory_is_flat(server, model, region_cap_mib):
    data = np.random.default_rng(0).integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN))
    measure(server, model, 100, 1_000, data, "TOKENS", "INT64", region_cap_mib=region_cap_mib,
            base="tag_pipeline")
