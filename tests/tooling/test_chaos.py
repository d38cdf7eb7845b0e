"""The chaos soak's accounting (reliability/chaos.py) on made-up outcomes: no server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from reliability import chaos
from reliability.chaos import Chaos, Kill, Outcome


def supervisor(reloader_events, events=()):
    return SimpleNamespace(reloader=SimpleNamespace(events=list(reloader_events)),
                           events=list(events), error=None)


def outcome(n, model, started, finished, result, kind="good", deadline=10.0, code=None,
            answered_id=None):
    rid = f"chaos-0-{n}"
    if result == "ok" and answered_id is None:
        answered_id = rid
    return Outcome(rid, model, "grpc", kind, deadline, started, finished, result, code, answered_id)


def test_each_request_lands_in_exactly_one_place():
    # pipeline killed at t=100, its reload from 100.1 to 101.0.
    kills = [(Kill("pipeline", 4242, 100.0), 100.0)]
    sup = supervisor([(100.1, "reload: pipeline: missing"), (101.0, "reloaded: pipeline")])
    outcomes = [
        outcome(0, "pipeline", 99.0, 99.5, "ok"),
        outcome(1, "pipeline", 99.5, 115.0, "no answer"),  # an orphan: the dead stub held it
        outcome(2, "pipeline", 100.5, 101.5, "error", code="StatusCode.INTERNAL"),  # at the kill
        outcome(3, "tag_pipeline", 99.5, 115.0, "no answer"),         # not the killed model: lost
        outcome(4, "pipeline", 105.0, 105.2, "error", code="StatusCode.INTERNAL"),  # innocent
        outcome(5, "pipeline", 105.0, 105.2, "ok", kind="bad_dtype"),  # accepted a bad input
        outcome(6, "pipeline", 106.0, 106.9, "ok", kind="short_deadline", deadline=0.002),  # late
        outcome(7, "pipeline", 107.0, 107.1, "cancelled", kind="cancel"),
        outcome(8, "pipeline", 108.0, 108.1, "ok", answered_id="chaos-0-0"),  # another's id
    ]
    result = Chaos(60, 8, 1, 10.0, sent=len(outcomes))
    chaos.account(result, outcomes, kills, sup, started=0.0)
    assert result.orphans == 1 and result.in_flight_at_kills == 1  # #2 was sent after it
    assert result.lost == 1
    assert result.innocent_failed_at_kills == 1 and result.innocent_failed == 1
    assert result.bad_accepted == 1
    assert result.answers_late == 1 and result.worst_excess_id == "chaos-0-6"
    assert result.answers_late_at_kills == 0
    assert result.mismatches == 1 and result.duplicates == 1
    assert result.kills[0].reload_s == 0.9 and result.kills[0].reloaded_s == 1.0
    assert result.by_kind["cancel"] == {"cancelled": 1}
    assert not result.clean
    assert {n["why"] for n in result.notable} == {
        "orphan", "lost", "innocent, in flight at a kill", "innocent failed",
        "bad input accepted", "late"}


def test_a_run_with_only_orphans_at_the_kill_is_clean():
    kills = [(Kill("tag_pipeline", 7, 50.0), 50.0)]
    sup = supervisor([(50.2, "reload: tag_pipeline: x"), (51.0, "reloaded: tag_pipeline")])
    outcomes = [outcome(i, "tag_pipeline", 49.0, 49.5 + i / 100, "ok") for i in range(20)]
    outcomes.append(outcome(99, "tag_pipeline", 49.9, 65.0, "no answer"))
    result = Chaos(60, 8, 1, 10.0, sent=len(outcomes))
    chaos.account(result, outcomes, kills, sup, started=0.0)
    assert result.orphans == 1 <= result.orphan_bound
    assert result.clean, result


def test_requests_are_drawn_in_the_promised_shares_and_repeatably():
    inputs = chaos.Inputs()

    def kinds(seed):
        rng = np.random.default_rng([seed, 3])
        return [chaos.draw(rng, "pipeline", inputs, 10.0, 5.0) for _ in range(20_000)]

    drawn = kinds(1)
    assert [r.kind for r in drawn[:200]] == [r.kind for r in kinds(1)[:200]]
    share = {k: sum(r.kind == k for r in drawn) / len(drawn) for k in chaos.KINDS}
    assert abs(share["cancel"] - 0.05) < 0.01 and abs(share["short_deadline"] - 0.05) < 0.01
    assert abs(share["bad_dtype"] + share["poison"] - 0.05) < 0.01 and share["bad_tokens"] == 0
    assert all(r.model == chaos.POISON_MODEL for r in drawn if r.kind == "poison")
    # The poisoned model sees bad inputs at about the 5 % every model sees, not more.
    there = [r for r in drawn if r.model == chaos.POISON_MODEL]
    assert 0.04 < sum(r.kind == "poison" for r in there) / len(there) < 0.07
    assert all(0.001 <= r.deadline_s <= 0.005 for r in drawn if r.kind == "short_deadline")
    assert all(r.limit_s <= 0.2 for r in drawn if r.kind == "cancel")
    assert all(r.limit_s == r.deadline_s + 5.0 for r in drawn if r.kind != "cancel")
    tags = [chaos.draw(np.random.default_rng(2), "tag_pipeline", inputs, 10.0, 5.0)
            for _ in range(2_000)]
    assert all(r.model == "tag_pipeline" and r.kind != "poison" for r in tags)


def test_late_answers_of_tritons_queue_are_told_apart_and_every_outcome_is_kept(tmp_path):
    outcomes = [
        Outcome("chaos-0-0", "pipeline", "grpc", "short_deadline", 0.002, 10.0, 12.0, "error",
                "StatusCode.UNAVAILABLE", None, "Request timeout expired"),
        Outcome("chaos-0-1", "pipeline", "http", "short_deadline", 0.002, 10.0, 11.0, "error",
                "503", None, "deadline exceeded in stage 'embedder' (model 'embedder'): ..."),
        outcome(2, "pipeline", 10.0, 10.1, "ok"),
    ]
    result = Chaos(60, 8, 1, 10.0, sent=len(outcomes))
    chaos.account(result, outcomes, [], supervisor([]), started=0.0)
    assert result.answers_late == 2 and result.answers_late_by_triton_queue == 1
    assert [n["why"] for n in result.notable] == ["late, by Triton's queue", "late"]
    assert not result.clean
    text = chaos.report(result, tmp_path / "out", "test", tmp_path / "raw", outcomes).read_text()
    assert "| late, by Triton's queue | `pipeline` | StatusCode.UNAVAILABLE | 1 |" in text
    lines = (tmp_path / "raw" / "chaos-requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [o.id for o in outcomes]


def test_lateness_counts_beyond_the_clients_own_ingest_and_the_verdict_allows_half_a_percent():
    """An answer 0.9 s past its deadline, when the clients wait 0.6 s (p99) for a model that
    answers at once, is late only by 0.3 s: within the slack. One 1.6 s past is late beyond it;
    one such answer in 400 is within the verdict's 0.5 %, two are not."""
    sup = supervisor([])
    on_time = [outcome(i, "pipeline", float(i), float(i) + 0.1, "ok") for i in range(398)]
    within = outcome(900, "pipeline", 500.0, 500.0 + 10.9, "ok")
    beyond = outcome(901, "pipeline", 600.0, 600.0 + 11.6, "ok")
    result = Chaos(60, 8, 1, 10.0, sent=400,
                   ingest_ms={"grpc pipeline": {"p50": 200.0, "p99": 600.0, "max": 700.0}})
    chaos.account(result, [*on_time, within, beyond], [], sup, started=0.0)
    assert result.answers_late == 2 and result.answers_late_beyond_ingest == 1
    assert result.clean
    worse = Chaos(60, 8, 1, 10.0, sent=400, ingest_ms=result.ingest_ms)
    again = outcome(902, "pipeline", 700.0, 700.0 + 11.6, "ok")
    chaos.account(worse, [*on_time[:-1], beyond, again], [], sup, started=0.0)
    assert worse.answers_late_beyond_ingest == 2 and not worse.clean
    assert {n["why"] for n in result.notable} == {"late", "late, within the client's own ingest"}
