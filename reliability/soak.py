"""`python -m reliability.soak` (`make soak`): a long, bounded load on both orchestrators that accounts
for every request, and watches the memory of every process while it runs.

    python -m reliability.soak                               # 100 000 requests at concurrency 512
    python -m reliability.soak --requests 5000 --concurrency 64
    python -m reliability.soak --url 127.0.0.1:8001          # against a server already running

One asyncio gRPC client sends ``--requests`` requests, alternating `pipeline` and
`tag_pipeline`, with at most ``--concurrency`` in flight and a deadline of ``--budget-s`` each;
it stops by itself after the last answer or after ``--max-seconds``. Every request carries a
unique id, and the answer must come back with that id. The soak reports:
- sent, answered, errors by status code, and lost: sent but never answered, which must be 0;
- duplicates, answers whose id was already answered, which must be 0;
- mismatches, answers that carry another request's id, which must be 0;
- p50 and p99 per model;
- Triton's own count of requests per orchestrator, which must equal what was sent;
- memory over time: tritonserver's resident memory, and each stub's private memory (RssAnon,
  what a leak grows; one series per stub, e.g. ``pipeline #0``) and its growth per 10 000
  requests after warm-up: a least-squares slope over the samples taken after the first tenth of
  the requests.

It writes ``soak.json`` (the summary), ``soak.csv`` (the memory samples), ``soak.png`` and
``soak.md`` into ``--out``, and the whole record (``soak.json``, samples included) into ``--raw``
(git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common import output_arguments
from bls_models import spec as S
from modelgen import nets
from reliability import memory
from tritonlocal import procs
from tritonlocal.launcher import group_stubs

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("pipeline", "tag_pipeline")


@dataclass
class Soak:
    requests: int
    concurrency: int
    seconds: float = 0.0
    sent: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)        # status code -> count
    error_examples: dict[str, str] = field(default_factory=dict)
    lost: int = 0
    duplicates: int = 0
    mismatches: int = 0
    unsent: int = 0                                             # not sent before --max-seconds
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    server_counted: dict[str, int] = field(default_factory=dict)  # Triton's success + failure
    memory_growth_mib_per_10k: dict[str, float] = field(default_factory=dict)
    memory_mib: dict[str, tuple[float, float]] = field(default_factory=dict)  # first, last
    samples: list[dict] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (self.lost == 0 and self.duplicates == 0 and self.mismatches == 0
                and not self.errors and self.unsent == 0
                and all(self.server_counted.get(m, -1) == n for m, n in self.sent.items()))


# -- memory of the server's processes ----------------------------------------------------------------
def process_memory(server_pid: int) -> dict[str, float]:
    """MiB, from /proc: tritonserver's resident memory (``tritonserver RSS``) and each stub's
    private memory (``<model> #<n> private``, stubs numbered in pid order)."""
    memory = {"tritonserver RSS": procs.memory_mib(server_pid).get("VmRSS", 0.0)}
    for model, pids in group_stubs(server_pid).items():
        for number, pid in enumerate(sorted(pids)):
            memory[f"{model} #{number} private"] = procs.memory_mib(pid).get("RssAnon", 0.0)
    return memory


def model_counts(http_url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=10) as reply:
        stats = json.load(reply)["model_stats"]
    return {s["name"]: int(s["inference_stats"]["success"]["count"])
            + int(s["inference_stats"]["fail"]["count"]) for s in stats}


# -- the load ---------------------------------------------------------------------------------------
async def run(grpc_url: str, http_url: str, server_pid: int | None, requests: int,
              concurrency: int, budget_s: float = 120.0, max_seconds: float = 3600.0,
              sample_every: float = 2.0) -> Soak:
    import tritonclient.grpc.aio as grpcaio

    soak = Soak(requests, concurrency)
    inputs = {"pipeline": ("IMAGE", "UINT8", nets.synthetic_images(1, seed=21).numpy()),
              "tag_pipeline": ("TOKENS", "INT64", np.random.default_rng(21).integers(
                  0, S.TAGGER_VOCAB, (1, S.TAGGER_SEQ_LEN)))}
    client = grpcaio.InferenceServerClient(grpc_url)
    slots = asyncio.Semaphore(concurrency)
    answers: collections.Counter[str] = collections.Counter()
    latencies: dict[str, list[float]] = {m: [] for m in MODELS}
    sent = collections.Counter()
    completed = 0
    before = model_counts(http_url)
    started = time.monotonic()
    stop_at = started + max_seconds

    async def one(i: int) -> None:
        nonlocal completed
        model = MODELS[i % len(MODELS)]
        request_id = f"soak-{i}"
        async with slots:
            if time.monotonic() >= stop_at:
                soak.unsent += 1
                return
            name, dtype, data = inputs[model]
            tensor = grpcaio.InferInput(name, list(data.shape), dtype)
            tensor.set_data_from_numpy(data)
            sent[model] += 1
            began = time.monotonic()
            try:
                result = await client.infer(model, [tensor], request_id=request_id,
                                            timeout=int(budget_s * 1e6),
                                            client_timeout=budget_s + 30)
            except Exception as error:  # noqa: BLE001 - every error is counted by its code
                code = str(getattr(error, "status", lambda: None)() or type(error).__name__)
                soak.errors[code] = soak.errors.get(code, 0) + 1
                soak.error_examples.setdefault(code, str(error)[:300])
                return
            finally:
                completed += 1
            answered_id = result.get_response().id
            if answered_id != request_id:
                soak.mismatches += 1
            answers[answered_id] += 1
            latencies[model].append(time.monotonic() - began)

    async def watch() -> None:
        while True:
            if server_pid is not None:
                soak.samples.append({"seconds": round(time.monotonic() - started, 2),
                                     "completed": completed, **process_memory(server_pid)})
            await asyncio.sleep(sample_every)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        watcher.cancel()
        await client.close()
    soak.seconds = time.monotonic() - started
    if server_pid is not None:
        soak.samples.append({"seconds": round(soak.seconds, 2), "completed": completed,
                             **process_memory(server_pid)})
    soak.sent = dict(sent)
    soak.answered = {m: len(v) for m, v in latencies.items()}
    soak.duplicates = sum(n - 1 for n in answers.values() if n > 1)
    soak.lost = sum(sent.values()) - sum(soak.answered.values()) - sum(soak.errors.values())
    soak.latency_ms = {m: {"p50": float(np.percentile(v, 50) * 1e3),
                           "p99": float(np.percentile(v, 99) * 1e3)} for m, v in latencies.items() if v}
    after = model_counts(http_url)
    soak.server_counted = {m: after.get(m, 0) - before.get(m, 0) for m in MODELS}
    soak.memory_mib, soak.memory_growth_mib_per_10k = memory.trends(soak.samples, requests)
    return soak


# -- report -----------------------------------------------------------------------------------------
def report(soak: Soak, out: Path, command: str, raw: Path | None = None) -> Path:
    """soak.{json,csv,png,md} into ``out``: the JSON is the summary (the memory samples are in
    the CSV); with ``raw``, the whole record, samples included, as ``raw``/soak.json (raw data:
    not for git)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {**asdict(soak), "clean": soak.clean, "command": command}
    if raw is not None:
        raw.mkdir(parents=True, exist_ok=True)
        (raw / "soak.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "soak.json").write_text(json.dumps({k: v for k, v in record.items() if k != "samples"},
                                              indent=2) + "\n")
    memory.write_csv(soak.samples, out / "soak.csv")
    if soak.samples:
        curves = {}
        for key in memory.series(soak.samples):
            points = [(s["completed"], s[key]) for s in soak.samples if key in s]
            if max(v for _, v in points) >= 20:  # leave out idle models' small stubs
                curves[key] = tuple(zip(*points))
        memory.plot(out / "soak.png", curves,
                    f"Soak: {soak.requests} requests at concurrency {soak.concurrency}",
                    "requests completed", "MiB (tritonserver: resident; stubs: private)")
    total_sent = sum(soak.sent.values())
    lines = [f"# Soak: {soak.requests} requests at concurrency {soak.concurrency}", "",
             f"`{command}` — {soak.seconds:.0f} s, {total_sent / soak.seconds:.0f} req/s. "
             f"Verdict: **{'clean' if soak.clean else 'NOT clean'}** (0 lost, 0 duplicates, 0 "
             "mismatched ids, 0 errors, Triton counted every request).", "",
             "| | " + " | ".join(f"`{m}`" for m in MODELS) + " |", "|---|" + "---|" * len(MODELS),
             "| sent | " + " | ".join(str(soak.sent.get(m, 0)) for m in MODELS) + " |",
             "| answered | " + " | ".join(str(soak.answered.get(m, 0)) for m in MODELS) + " |",
             "| counted by Triton | " + " | ".join(str(soak.server_counted.get(m, 0))
                                                  for m in MODELS) + " |",
             "| p50 / p99 (ms) | " + " | ".join(
                 f"{soak.latency_ms[m]['p50']:.0f} / {soak.latency_ms[m]['p99']:.0f}"
                 if m in soak.latency_ms else "–" for m in MODELS) + " |", "",
             f"- lost: **{soak.lost}**; duplicates: **{soak.duplicates}**; mismatched ids: "
             f"**{soak.mismatches}**; not sent (time limit): {soak.unsent}",
             "- errors by code: " + (", ".join(f"{c}: {n}" for c, n in soak.errors.items())
                                     or "none"),
             *[f"  - e.g. {c}: {e}" for c, e in soak.error_examples.items()], "",
             "| process (memory) | first → last sample (MiB) | growth per 10 000 requests after "
             "warm-up (MiB) |",
             "|---|---|---|"]
    for key, (first, last) in sorted(soak.memory_mib.items(), key=lambda kv: -kv[1][1]):
        if last >= 20:
            lines.append(f"| {key} | {first:.0f} → {last:.0f} | "
                         f"{soak.memory_growth_mib_per_10k.get(key, float('nan')):+.1f} |")
    lines += ["", "![memory over the run](soak.png)", ""]
    path = out / "soak.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--budget-s", type=float, default=120.0, help="deadline of each request")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="stop sending after this")
    parser.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--http-url", help="its HTTP host:port (with --url; for Triton's counts)")
    output_arguments(parser, "where the whole record goes, memory samples included (git-ignored)")
    args = parser.parse_args(argv)
    command = "python -m reliability.soak " + " ".join(argv if argv is not None else sys.argv[1:])

    def go(grpc_url: str, http_url: str, pid: int | None) -> Soak:
        return asyncio.run(run(grpc_url, http_url, pid, args.requests, args.concurrency,
                               args.budget_s, args.max_seconds))

    if args.url:
        if not args.http_url:
            parser.error("--url needs --http-url (Triton's request counts come from HTTP)")
        soak = go(args.url, args.http_url, None)
    else:
        from tritonlocal import TritonServer, on_free_ports

        # The server's log is kept (.triton/, git-ignored) to explain a run that was not clean.
        log = ROOT / ".triton" / f"soak-tritonserver-{time.strftime('%Y%m%d-%H%M%S')}.log"
        with TritonServer(on_free_ports(args.model_repository, log)) as server:
            print(f"server log: {log}", flush=True)
            soak = go(server.grpc_url, server.http_url, server.process.pid)
    path = report(soak, args.out, command.strip(), args.raw)
    print(path.read_text())
    return 0 if soak.clean else 1


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
