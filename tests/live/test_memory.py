"""Over thousands of requests the orchestrators' stub processes do not grow: what a leak would do.

Two figures per stub, printed (pytest -s) and recorded in docs/orchestrator.md:
- private memory (RssAnon): what a leak grows — a copy of every input kept, responses never
  released. It is also what glibc's malloc keeps of freed memory: coalesced sub-requests
  concatenate their members' tensors into buffers of several MB, which raise glibc's dynamic
  mmap threshold, so later buffers come from the heap, which keeps their pages after free. That
  plateau (measured: 80 to 220 MiB per `pipeline` stub, wandering by ±30 MiB between samples
  and creeping up to ~30 MiB over the first 10 000 requests) is not a leak: a leak grows with
  every request, the plateau does not.
  So the run is sampled after each tenth and the test compares the median of the last three
  samples with the median of the first three (seven tenths apart: 2 100 `pipeline` requests
  after 1 000 warm-up): growth must stay under PRIVATE_BOUND_MIB. A leak of one input image per
  request (147 KB) would grow each of the two `pipeline` stubs by ~150 MiB over those 2 100; the
  bound catches a leak of ~62 KB per request. The stubs over the logits tagger have their own
  bound (their test says why).
- the python backend's shared-memory region: a pool that grows to the peak of tensors alive at
  once and never shrinks (Triton 2.51). The server is the suite's, so earlier tests (overload,
  bursts of large batches) may have grown it already, and a short warm-up on a fresh server may
  not have reached this load's peak (the logits tagger's: 144 MiB after the warm-up, 256 at the
  end, in one run): the region must end within a cap derived from this load's peak (or the
  budget /dev/shm is sized with), or within one growth step (16 MiB) of its size after the
  warm-up when earlier tests had grown it past that cap. A region that leaked tensors would grow
  past both.
"""

from __future__ import annotations

import asyncio
import statistics

import numpy as np

from bls_models import spec as S
from tests.helpers import drive, image, memory, stub_pids

PRIVATE_BOUND_MIB = 64
GROWTH_STEP_MIB = 16  # shm-growth-byte-size (tritonlocal.shm)
START_MIB = 32        # shm-default-byte-size
SAMPLES = 10  # the measured run is sent in this many parts, private memory sampled after each


def run(server, model, count, data, name, dtype):
    outcomes = asyncio.run(drive(server.grpc_url, model, count=count, concurrency=32, data=data,
                                 name=name, dtype=dtype, prefix=f"memory-{model}"))
    errors = [e for _, _, e in outcomes if e is not None]
    assert errors == [], f"{len(errors)} errors, e.g. {errors[:2]}"


def measure(server, model, warm_up, requests, data, name, dtype, region_cap_mib, base=None,
            bound_mib=PRIVATE_BOUND_MIB):
    pids = stub_pids(server, model)
    assert len(pids) == S.model(base or model).instance_count
    run(server, model, warm_up, data, name, dtype)
    before = {pid: memory(pid)["region"] for pid in pids}
    samples = {pid: [] for pid in pids}
    for _ in range(SAMPLES):
        run(server, model, requests // SAMPLES, data, name, dtype)
        for pid in pids:
            samples[pid].append(memory(pid))
    print(f"\n{model}: {requests} requests at concurrency 32 after {warm_up} warm-up, private "
          "MiB after each tenth; shm region MiB at the end:")
    for pid, taken in samples.items():
        print(f"  stub {pid}: " + " ".join(f"{s['private']:.0f}" for s in taken)
              + f"; region {before[pid]:.0f} after the warm-up, "
              f"{taken[-1]['region']:.0f} at the end")
    for pid, taken in samples.items():
        private = [s["private"] for s in taken]
        growth = statistics.median(private[-3:]) - statistics.median(private[:3])
        assert growth < bound_mib, (pid, private)
        assert taken[-1]["region"] <= max(region_cap_mib, before[pid] + GROWTH_STEP_MIB), (
            pid, before[pid], taken[-1])


def test_pipeline_stub_memory_is_flat_over_3000_requests(server):
    # Per request in flight: the input image, the sub-requests' IMAGE and 2 x PIXELS, their
    # outputs: about 2 MiB; 32 in flight, twice that for fragmentation, plus the 32 MiB start.
    measure(server, "pipeline", 1_000, 3_000, image(seed=3), "IMAGE", "UINT8",
            region_cap_mib=START_MIB + 2 * 32 * 2)


def test_tag_pipeline_stub_memory_is_flat(server):
    # Over tagger_tags (committed): 8 bytes per token come back; the region never needs to grow
    # past its 32 MiB start.
    data = np.random.default_rng(0).integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN))
    measure(server, "tag_pipeline", 100, 500, data, "TOKENS", "INT64", region_cap_mib=START_MIB)


def test_tag_pipeline_over_logits_stub_memory_is_flat(server):
    # Over the logits tagger: 28.7 MB per sequence pass through the orchestrator and none may
    # stay. The python backend copies each tagger response into the stub's heap as it loads
    # (backend.owns_memory): 28.7 MB per sequence, up to 4 per coalesced group. glibc keeps
    # a growing set of such blocks for the first few thousand requests (measured: +27 MiB steps,
    # +137 MiB on one stub over 2 800 requests, then flat at 145 to 240 MiB), so the bound is
    # 192 MiB: one leaked response per request would grow a stub by ~5 GB over this run.
    # The region stays within the budget `python -m tritonlocal.shm` sizes /dev/shm with: one
    # full batch (4 sequences) of logits per sub-request thread (8), plus the 32 MiB start (peaks
    # of 144 to 464 MiB measured over four runs with coalescing).
    data = np.random.default_rng(0).integers(0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN))
    measure(server, "tag_pipeline_logits", 300, 500, data, "TOKENS", "INT64",
            region_cap_mib=START_MIB + 8 * 4 * 28.7, base="tag_pipeline", bound_mib=192)
