"""A steady one-in-ten share of poisoned requests, 32 gRPC clients, the committed preprocess CNN
and an embedder stage that fails its whole batch on one poisoned row (`pipeline_poison_embedder`,
batching as the committed embedder does): every innocent request succeeds, every poisoned one
is INVALID_ARG, and the orchestrator's stubs do not grow (reliability/poison_load.py is the long
run; docs/reliability.md has its figures).

The bound: the median of the last three samples of the stubs' private memory at most
``GROWTH_BOUND_MIB`` above the median of the first three after the warm-up. Before the fix of
the reference cycles (tests/unit/test_memory.py) this load grew them by ~1.7 GB per 10 000
requests: about 500 MiB over this run.
"""

from __future__ import annotations

import asyncio
import statistics

from reliability.poison_load import MODEL, Steady, steady

SECONDS = 30.0
WARM_UP_S = 6.0
GROWTH_BOUND_MIB = 64


def test_a_steady_share_of_poisoned_requests_fails_no_innocent_and_grows_no_stub(server):
    result = asyncio.run(steady(server, Steady(MODEL, SECONDS, 32, 0.1, ("EMBEDDING",)),
                                sample_every=1.0, progress=print))
    print({kind: codes for kind, codes in result.codes.items()}, result.latency_ms)
    assert result.sent.get("poisoned", 0) > 50 and result.sent.get("good", 0) > 500
    assert result.innocent_failed == 0, result.codes["good"]
    assert result.bad_not_refused == 0, result.codes["poisoned"]
    key = f"{MODEL} stubs private"
    after = [s[key] for s in result.samples if s["seconds"] >= WARM_UP_S]
    grown = statistics.median(after[-3:]) - statistics.median(after[:3])
    print(f"{key}: {[round(v) for v in after]} MiB, grown {grown:+.0f} MiB")
    assert grown <= GROWTH_BOUND_MIB, f"the stubs grew {grown:.0f} MiB over {SECONDS:.0f} s"
