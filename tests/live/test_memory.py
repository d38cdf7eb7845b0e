"""After 10 000 requests the orchestrators' stub processes use no more memory than after warm-up.

The figure is printed (pytest -s, or the report's captured output) and recorded in
docs/orchestrator.md; the bound is generous on purpose: it catches leaks (a copy of every input
kept, responses never released), not allocator noise.
"""

from __future__ import annotations

import asyncio

import numpy as np

from bls_models import spec as S
from tests.live.support import drive, image, rss_bytes, stub_pids

WARM_UP = 1_000
REQUESTS = 10_000
BOUND_MB = 32  # per stub process, over 10 000 requests after warm-up


def run(server, model, count, data, name, dtype):
    outcomes = asyncio.run(drive(server.grpc_url, model, count=count, concurrency=32, data=data,
                                 name=name, dtype=dtype, prefix=f"memory-{model}"))
    errors = [e for _, _, e in outcomes if e is not None]
    assert errors == [], f"{len(errors)} errors, e.g. {errors[:2]}"


def test_pipeline_stub_memory_is_flat_over_10000_requests(server):
    pids = stub_pids(server, "pipeline")
    assert len(pids) == S.PIPELINE.instance_count
    data = image(seed=3)
    run(server, "pipeline", WARM_UP, data, "IMAGE", "UINT8")
    before = {pid: rss_bytes(pid) for pid in pids}
    run(server, "pipeline", REQUESTS, data, "IMAGE", "UINT8")
    after = {pid: rss_bytes(pid) for pid in pids}
    growth_mb = {pid: (after[pid] - before[pid]) / 2**20 for pid in pids}
    print(f"\npipeline stub RSS over {REQUESTS} requests after {WARM_UP} warm-up: "
          + ", ".join(f"pid {pid}: {before[pid] / 2**20:.1f} -> {after[pid] / 2**20:.1f} MiB "
                      f"({growth_mb[pid]:+.1f})" for pid in pids))
    assert all(growth < BOUND_MB for growth in growth_mb.values()), growth_mb


def test_tag_pipeline_stub_memory_is_flat(server):
    """The 28.7 MB-per-sequence logits pass through the orchestrator; none of them may stay."""
    pids = stub_pids(server, "tag_pipeline")
    data = np.random.default_rng(0).integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN))
    run(server, "tag_pipeline", 100, data, "TOKENS", "INT64")
    before = {pid: rss_bytes(pid) for pid in pids}
    run(server, "tag_pipeline", 500, data, "TOKENS", "INT64")
    after = {pid: rss_bytes(pid) for pid in pids}
    growth_mb = {pid: (after[pid] - before[pid]) / 2**20 for pid in pids}
    print(f"\ntag_pipeline stub RSS over 500 requests after 100 warm-up: "
          + ", ".join(f"{before[p] / 2**20:.1f} -> {after[p] / 2**20:.1f} MiB" for p in pids))
    assert all(growth < BOUND_MB for growth in growth_mb.values()), growth_mb
