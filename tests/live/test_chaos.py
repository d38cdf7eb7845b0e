"""The chaos soak's short version (`make soak CHAOS=1` is the long one): 24 s of load on both
orchestrators with bad inputs, cancelled calls, deadlines too short to meet and one stub
SIGKILLed, every request accounted for.

It starts its own server (the committed repository plus the test variants, as the session
server serves them) with the launcher's supervisor; the session server is never disturbed."""

from __future__ import annotations

import asyncio

from reliability import chaos
from tests.helpers import server_options
from tritonlocal import TritonServer
from tritonlocal.launcher import Supervisor

SECONDS = 24.0
KILL_EVERY = 24.0   # one kill, 12 s in (reloaded in 3 to 5 s here)
CONCURRENCY = 32


def test_a_short_chaos_soak_answers_every_request_once_and_fails_no_innocent(
        repository, fault_repository, tmp_path):
    options = server_options(repository, tmp_path, stop_grace=5.0,
                             extra_args=[f"--model-repository={fault_repository}"])
    with TritonServer(options) as server:
        supervisor = Supervisor(server, restart_grace=5.0, retire_grace=3.0,
                                log=lambda line: print(line)).start()
        try:
            # No ingest measurement (it needs chaos.write_echo_models' models and 10 s): this
            # test holds the accounting, not the lateness verdict.
            result = asyncio.run(chaos.run(server, supervisor, SECONDS, CONCURRENCY, seed=29,
                                           kill_every=KILL_EVERY, ingest_s=0))
        finally:
            supervisor.stop()
    text = chaos.report(result, tmp_path, "test").read_text()
    print(text)
    by_kind = result.by_kind
    # Every kind of request was sent and the stub was killed: the run tested something.
    assert set(by_kind) == set(chaos.KINDS), by_kind
    assert len(result.kills) == 1 and result.kills[0].reloaded_s is not None, result.kills
    # Exactly once: nothing lost, no id answered twice or answered with another's; r24.10 fails
    # the requests of an execute its stub died in, and strands at most what the killed instance
    # owed past execute (its max_owed_answers).
    assert result.lost == 0, [n for n in result.notable if n["why"] == "lost"]
    assert result.duplicates == 0 and result.mismatches == 0
    assert result.orphans <= result.orphan_bound == 4, result.kills
    # Innocent requests fail only in flight at the kill, and only on the killed model.
    assert result.innocent_failed == 0, [n for n in result.notable if n["why"] == "innocent failed"]
    assert result.bad_accepted == 0
    assert by_kind["good"].get("ok", 0) > 0 and by_kind["poison"].get("error", 0) > 0
    # The stub's death cost a reload of its model, never the whole server.
    assert result.server_restarts == 0 and not result.reload_failures, result.reload_failures
    assert not result.supervisor_error
    assert (tmp_path / "chaos.csv").exists() and "Verdict" in text
