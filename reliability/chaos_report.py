"""The chaos soak's report: chaos.{json,csv,png,md} from a ``Chaos``, and every request's
outcome, one JSON line each, into the raw directory (not for git)."""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from reliability import memory
from reliability.accounting import (
    ANSWER_SLACK_S,
    KINDS,
    LATE_SHARE,
    TRITON_QUEUE_TIMEOUT,
    Chaos,
    Outcome,
)

SHOWN = 50                    # requests of each reason listed in chaos.md (and kept in chaos.json)


def shown(chaos: Chaos, limit: int = SHOWN) -> list[dict]:
    """The first ``limit`` notable requests of each reason."""
    seen: collections.Counter = collections.Counter()
    kept = []
    for n in chaos.notable:
        seen[n["why"]] += 1
        if seen[n["why"]] <= limit:
            kept.append(n)
    return kept


def report(chaos: Chaos, out: Path, command: str, raw: Path | None = None,
           outcomes: list[Outcome] | None = None) -> Path:
    """chaos.{json,csv,png,md} into ``out`` (the JSON is the summary: the memory samples are in
    the CSV); into ``raw`` (raw data: not for git), every request's outcome, one JSON line each,
    as chaos-requests.jsonl, and the whole record, samples included, as chaos.json."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {**asdict(chaos), "notable": shown(chaos), "clean": chaos.clean,
               "command": command}
    if raw is not None:
        raw.mkdir(parents=True, exist_ok=True)
        (raw / "chaos.json").write_text(json.dumps(summary, indent=1) + "\n")
        if outcomes is not None:
            with (raw / "chaos-requests.jsonl").open("w") as handle:
                for o in outcomes:
                    handle.write(json.dumps(asdict(o)) + "\n")
    (out / "chaos.json").write_text(json.dumps({k: v for k, v in summary.items()
                                                if k != "samples"}, indent=1) + "\n")
    memory.write_csv(chaos.samples, out / "chaos.csv")
    plotted = _plot(chaos, out / "chaos.png")
    total = sum(sum(r.values()) for r in chaos.by_kind.values())
    rate = total / chaos.duration_s if chaos.duration_s else 0.0
    results = ("ok", "error", "cancelled", "no answer")
    lines = [f"# Chaos soak: {chaos.seconds:.0f} s at concurrency {chaos.concurrency}", "",
             f"`{command}` — {chaos.duration_s:.0f} s, {total} requests ({rate:.0f} req/s), seed "
             f"{chaos.seed}, {time.strftime('%Y-%m-%d %H:%M')} on this host ({os.cpu_count()} "
             f"cores). Verdict: **{'clean' if chaos.clean else 'NOT clean'}**.", "",
             "| kind | " + " | ".join(results) + " | error codes |",
             "|---|" + "---|" * (len(results) + 1)]
    for kind in KINDS:
        if kind in chaos.by_kind:
            counts = chaos.by_kind[kind]
            lines.append(f"| {kind} | " + " | ".join(str(counts.get(r, 0)) for r in results)
                         + " | " + ", ".join(f"{c}: {n}" for c, n in
                                             sorted(chaos.codes.get(kind, {}).items())) + " |")
    lines += ["",
              f"- lost: **{chaos.lost}**; duplicates: **{chaos.duplicates}**; mismatched ids: "
              f"**{chaos.mismatches}**",
              f"- stranded (in flight on a killed stub's model, never answered: owed past "
              f"`execute`, r24.10): **{chaos.orphans}** of {chaos.in_flight_at_kills} in flight "
              f"at the kills (bound: `max_owed_answers` per killed instance, "
              f"{chaos.orphan_bound} in all)",
              f"- innocent requests failed: **{chaos.innocent_failed}** elsewhere, "
              f"{chaos.innocent_failed_at_kills} in flight at a kill",
              f"- bad inputs answered with a success: **{chaos.bad_accepted}**",
              f"- answers later than deadline + {ANSWER_SLACK_S} s beyond the client's own "
              f"ingest: **{chaos.answers_late_beyond_ingest}** of {chaos.answered} "
              f"({100 * chaos.answers_late_beyond_ingest / max(chaos.answered, 1):.2f} %; "
              f"bound {100 * LATE_SHARE:g} %); the ingest's p99: " + ", ".join(
                  f"{k} {v['p99']:.0f} ms" for k, v in chaos.ingest_ms.items()),
              f"- answers later than deadline + {ANSWER_SLACK_S} s, unadjusted: "
              f"**{chaos.answers_late}**, {chaos.answers_late_by_triton_queue} of them by "
              f"Triton's queue "
              f"(\"{TRITON_QUEUE_TIMEOUT}\"), {chaos.answers_late_at_kills} in flight during a "
              f"reload; worst excess over the deadline {chaos.worst_excess_s:+.3f} s "
              f"(`{chaos.worst_excess_id}`)",
              f"- whole-server restarts: **{chaos.server_restarts}**; reloads: {chaos.reloads} "
              f"for {len(chaos.kills)} kills; failed reloads: {chaos.reload_failures or 'none'}"
              + (f"; supervisor stopped: {chaos.supervisor_error}"
                 if chaos.supervisor_error else ""),
              "- innocent latency: " + "; ".join(
                  f"`{m}` p50 {v['p50']:.0f} ms, p99 {v['p99']:.0f} ms ({v['n']})"
                  for m, v in chaos.latency_ms.items()), "",
              "| kill at (s) | model | stub | kill → reload starts (s) | reload (s) | kill → "
              "serving (s) | in flight | orphans | innocent failed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k in chaos.kills:
        lines.append(f"| {k.at_s:.1f} | `{k.model}` | {k.pid} | {k.detected_s} | {k.reload_s} | "
                     f"{k.reloaded_s} | {k.in_flight} | {k.orphans} | {k.innocent_failed} |")
    lines += ["", "| memory | first → last sample | growth per 10 000 requests after warm-up |",
              "|---|---|---|"]
    for key, (first, last) in sorted(chaos.memory_mib.items(), key=lambda kv: -kv[1][1]):
        unit = "" if key.endswith("count") else " MiB"
        lines.append(f"| {key} | {first:.0f} → {last:.0f}{unit} | "
                     f"{chaos.memory_growth_mib_per_10k.get(key, float('nan')):+.1f}{unit} |")
    reasons = collections.Counter((n["why"], n["model"], n["code"] or n["result"])
                                  for n in chaos.notable)
    if reasons:
        lines += ["", "Requests that did not end as their kind should, by reason (every "
                      "request's outcome: `chaos-requests.jsonl` in the raw directory):", "",
                  "| reason | model | code | requests |", "|---|---|---|---|"]
        lines += [f"| {why} | `{model}` | {code} | {n} |"
                  for (why, model, code), n in sorted(reasons.items())]
    listed = [n for n in shown(chaos, 10) if n["why"] != "innocent, in flight at a kill"]
    if listed:
        lines += ["", "The first 10 of each reason (more in chaos.json):", ""]
        lines += [f"- `{n['id']}` {n['model']} {n['protocol']} {n['kind']}: {n['why']}, "
                  f"{n['result']} {n['code'] or ''} after {n['seconds']} s (sent at "
                  f"{n['started_s']} s) {n['message'][:120]}" for n in listed]
    if plotted:
        lines += ["", "![memory over the run](chaos.png)"]
    path = out / "chaos.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot(chaos: Chaos, path: Path) -> bool:
    if len(chaos.samples) < 2:
        return False
    completed = [s["completed"] for s in chaos.samples]
    curves = {key: (completed, [s.get(key, float("nan")) for s in chaos.samples])
              for key in memory.series(chaos.samples) if not key.endswith("count")}
    marks = []
    for kill in chaos.kills:
        done = [s["completed"] for s in chaos.samples if s["seconds"] >= kill.at_s]
        if done:
            marks.append(done[0])
    return memory.plot(path, curves,
                       f"Chaos soak: {chaos.seconds:.0f} s at concurrency {chaos.concurrency}",
                       "requests completed (dotted: a stub SIGKILLed)", "MiB", marks)
