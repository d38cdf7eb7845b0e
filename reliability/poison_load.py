"""`python -m reliability.poison_load` (`make bench-poison-load`): a steady share of bad requests.

Closed-loop gRPC clients send `pipeline_poison_embedder` requests (`pipeline` whose embedder
stage is a model that fails its whole batch when one row is poisoned: modelgen/poison.py),
asking for EMBEDDING, one in ten poisoned; the orchestrator must find the bad rows
(bls_models/isolation.py) so that every innocent request succeeds, while its stubs' memory
stays flat. Measured: innocents failed, bad requests answered otherwise than INVALID_ARG,
throughput, latency, and the stubs' private memory (RssAnon) per 10 000 requests after the
first tenth of the run (reliability/memory.py). Writes poison_load.{json,csv,md,png}.

    python -m reliability.poison_load                     # 120 s, 32 clients, one in ten poisoned
    python -m reliability.poison_load --seconds 30 --share 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common import output_arguments
from bls_models import spec as S
from modelgen import poison
from reliability import memory
from tritonlocal import launcher, procs

MODEL = "pipeline_poison_embedder"


@dataclass
class Steady:
    model: str
    seconds: float
    clients: int
    share: float
    outputs: tuple[str, ...]
    sent: dict[str, int] = field(default_factory=dict)          # kind -> requests
    codes: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> code -> n
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    requests_per_s: float = 0.0
    samples: list[dict] = field(default_factory=list)
    growth_mib_per_10k: dict[str, float] = field(default_factory=dict)
    memory_mib: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def innocent_failed(self) -> int:
        return sum(n for code, n in self.codes.get("good", {}).items() if code != "SUCCESS")

    @property
    def bad_not_refused(self) -> int:
        return sum(n for code, n in self.codes.get("poisoned", {}).items()
                   if code != "StatusCode.INVALID_ARGUMENT")


def images(seed: int = 17) -> tuple[np.ndarray, np.ndarray]:
    """A good image (never the poison colour) and the same image poisoned."""
    image = np.random.default_rng(seed).integers(0, 256, (1, *S.IMAGE.dims), dtype=np.uint8)
    image[0, 0, 0, :] = 0
    return image, poison.poison_image(image)


async def steady(server: launcher.TritonServer, result: Steady, sample_every: float = 2.0,
                 progress=print) -> Steady:
    """``result.clients`` closed-loop clients for ``result.seconds``; the stubs' memory sampled
    every ``sample_every`` seconds."""
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException

    good, bad = images()
    client = grpcaio.InferenceServerClient(server.grpc_url)
    wanted = [grpcaio.InferRequestedOutput(name) for name in result.outputs]
    waited: dict[str, list[float]] = {"good": [], "poisoned": []}
    completed = 0
    started = time.monotonic()
    stop_at = started + result.seconds

    async def one(index: int) -> None:
        nonlocal completed
        rng = np.random.default_rng([29, index])
        while time.monotonic() < stop_at:
            kind = "poisoned" if rng.random() < result.share else "good"
            data = bad if kind == "poisoned" else good
            tensor = grpcaio.InferInput("IMAGE", list(data.shape), "UINT8")
            tensor.set_data_from_numpy(data)
            began = time.monotonic()
            try:
                await client.infer(result.model, [tensor], outputs=wanted)
                code = "SUCCESS"
            except InferenceServerException as error:
                code = str(error.status())
            waited[kind].append(time.monotonic() - began)
            result.sent[kind] = result.sent.get(kind, 0) + 1
            codes = result.codes.setdefault(kind, {})
            codes[code] = codes.get(code, 0) + 1
            completed += 1

    async def watch() -> None:
        last = started
        while True:
            pids = server.stub_pids(result.model)
            result.samples.append({
                "seconds": round(time.monotonic() - started, 2), "completed": completed,
                f"{result.model} stubs private": sum(procs.memory_mib(pid).get("RssAnon", 0.0)
                                                     for pid in pids)})
            if time.monotonic() - last >= 30:
                last = time.monotonic()
                progress(f"poison_load: {last - started:5.0f} s, {completed} done, "
                         f"innocents failed {result.innocent_failed}")
            await asyncio.sleep(sample_every)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(one(i) for i in range(result.clients)))
    finally:
        watcher.cancel()
        await client.close()
    elapsed = time.monotonic() - started
    result.samples.append({"seconds": round(elapsed, 2), "completed": completed,
                           f"{result.model} stubs private": sum(
                               procs.memory_mib(pid).get("RssAnon", 0.0)
                               for pid in server.stub_pids(result.model))})
    result.requests_per_s = completed / elapsed
    result.latency_ms = {kind: {"p50": float(np.percentile(v, 50) * 1e3),
                                "p99": float(np.percentile(v, 99) * 1e3)}
                         for kind, v in waited.items() if v}
    result.memory_mib, result.growth_mib_per_10k = memory.trends(result.samples, completed)
    return result


def report(result: Steady, out: Path, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    summary = {**asdict(result), "innocent_failed": result.innocent_failed,
               "bad_not_refused": result.bad_not_refused, "command": command}
    (out / "poison_load.json").write_text(json.dumps(
        {k: v for k, v in summary.items() if k != "samples"}, indent=1) + "\n")
    memory.write_csv(result.samples, out / "poison_load.csv")
    key = f"{result.model} stubs private"
    plotted = memory.plot(out / "poison_load.png",
                          {key: ([s["completed"] for s in result.samples],
                                 [s[key] for s in result.samples])},
                          f"{result.model}: one in {1 / result.share:.0f} requests poisoned",
                          "requests completed", "MiB")
    sent = sum(result.sent.values())
    first, last = result.memory_mib.get(key, (float("nan"), float("nan")))
    lines = [f"# A steady share of poisoned requests: `{result.model}`", "",
             f"`{command}` — {time.strftime('%Y-%m-%d %H:%M')}, {result.clients} gRPC clients, "
             f"{result.seconds:.0f} s, outputs {', '.join(result.outputs)}.", "",
             f"- requests: {sent} ({result.requests_per_s:.0f}/s), "
             f"{result.sent.get('poisoned', 0)} poisoned",
             f"- innocent requests failed: **{result.innocent_failed}** "
             f"({result.codes.get('good', {})})",
             f"- poisoned requests not answered INVALID_ARG: **{result.bad_not_refused}** "
             f"({result.codes.get('poisoned', {})})",
             "- latency: " + "; ".join(f"{kind} p50 {v['p50']:.0f} ms, p99 {v['p99']:.0f} ms"
                                       for kind, v in result.latency_ms.items()),
             f"- the stubs' private memory: {first:.0f} → {last:.0f} MiB, "
             f"{result.growth_mib_per_10k.get(key, float('nan')):+.1f} MiB per 10 000 requests "
             "after the first tenth"]
    if plotted:
        lines += ["", "![private memory](poison_load.png)"]
    path = out / "poison_load.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability.poison_load",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--share", type=float, default=0.1, help="poisoned share (0.1)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--outputs", default="EMBEDDING",
                        help="comma-separated outputs to ask for (EMBEDDING)")
    output_arguments(parser, "unused")
    args = parser.parse_args(argv)
    command = "python -m reliability.poison_load " + " ".join(
        argv if argv is not None else sys.argv[1:])
    from bench import repository

    with tempfile.TemporaryDirectory(prefix="poison-load-") as scratch:
        variants = repository.build_test_repository(Path(scratch) / "variants",
                                                     args.model_repository)
        log = Path(scratch) / "tritonserver.log"
        options = launcher.on_free_ports(args.model_repository, log, stop_grace=5.0,
                                         extra_args=[f"--model-repository={variants}"])
        with launcher.TritonServer(options) as server:
            result = asyncio.run(steady(server, Steady(
                args.model, args.seconds, args.clients, args.share,
                tuple(args.outputs.split(",")))))
    path = report(result, args.out, command.strip())
    print(path.read_text())
    return 0 if result.innocent_failed == 0 and result.bad_not_refused == 0 else 1


if __name__ == "__main__":
    from bench.common import run_as_program

    run_as_program(main)
