"""The soak's short version: a thousand requests on both orchestrators, every one accounted
for. The long run is `make soak` (docs/reliability.md has its figures)."""

from __future__ import annotations

import asyncio

from reliability import soak


def test_a_short_soak_loses_nothing_and_answers_each_request_once(server, tmp_path):
    result = asyncio.run(soak.run(server.grpc_url, server.http_url, server.process.pid,
                                  requests=1_000, concurrency=128, max_seconds=600))
    assert result.errors == {}, result.error_examples
    assert result.lost == 0 and result.duplicates == 0 and result.mismatches == 0
    assert result.unsent == 0
    assert sum(result.sent.values()) == 1_000
    assert result.answered == result.sent
    # Triton's own count of requests per orchestrator agrees with the client's.
    assert result.server_counted == result.sent
    assert result.clean
    # The report renders from the result (the long run's figures come from the same code).
    text = soak.report(result, tmp_path, "test").read_text()
    assert "Verdict: **clean**" in text and (tmp_path / "soak.csv").exists()
