"""Far above capacity, `pipeline` over gRPC: closed-loop clients against the committed queue and a
shedding variant sized to this host (`make bench-overload`)."""

from __future__ import annotations

from bench import perf
from bench.common import Context, Result
from bench.repository import SHEDDING_PIPELINE, variant_specs
from bls_models import spec as S
from modelgen import nets
from tritonlocal import load


def _admission(spec: S.ModelSpec) -> int:
    """Requests a model takes before refusing: a batch running in each instance (an instance
    runs one at a time), plus its queue in Triton (the queue policy's ``max_queue_size``)."""
    return spec.instance_count * spec.max_batch_size + spec.batching.max_queue_size


def overload(ctx: Context) -> Result:
    result = Result("overload", "Overload: closed-loop clients far above capacity (`pipeline`, gRPC)")
    levels = [8, 64] if ctx.quick else [16, 64, 256, 1024]
    seconds = 3.0 if ctx.quick else 20.0
    backoff = 0.1  # a refused client waits this long before it tries again
    data = nets.synthetic_images(1, seed=7).numpy()
    shedding = next(spec for spec, _ in variant_specs(ctx.repository)
                    if spec.name == SHEDDING_PIPELINE)
    models = {"pipeline": S.PIPELINE, SHEDDING_PIPELINE: shedding}
    result.summary += [
        f"Each client sends its next request as soon as the last is answered ({seconds:.0f} s per "
        f"level, {backoff * 1e3:.0f} ms pause after an error), with no request timeout: the "
        "orchestrator's default "
        f"deadline ({int(S.PIPELINE.parameters['default_deadline_ms']) // 1000} s) applies. "
        "Refused: UNAVAILABLE because a queue was full; late: the orchestrator's deadline error.",
        "", "| model (admits at most) | clients | answered/s | answered p50 / p99 (ms) | refused "
        "| refused p50 / p99 (ms) | late | other errors |", "|---|---|---|---|---|---|---|---|"]
    for name, spec in models.items():
        for clients_count in levels:
            answers = load.closed_loop_for(ctx.server.grpc_url, name, clients_count, data,
                                              seconds, retry_pause=backoff)
            wall = max(a.finished for a in answers) - min(a.started for a in answers)
            ok = [a.seconds for a in answers if a.code is None]
            refused = [a.seconds for a in answers if a.code and "queue" in a.message.lower()]
            late = [a for a in answers if a.code and "deadline exceeded" in a.message]
            other = len(answers) - len(ok) - len(refused) - len(late)
            p = perf.point(clients_count, ok, wall)
            r = perf.point(clients_count, refused, wall)
            result.add(name, p, errors=len(answers) - len(ok), refused=len(refused),
                       late=len(late), other_errors=other, refused_p50_ms=r.p50_ms,
                       refused_p99_ms=r.p99_ms, admits=_admission(spec))
            result.summary.append(
                f"| `{name}` ({_admission(spec)}) | {clients_count} | {p.throughput:.0f} | "
                f"{p.p50_ms:.0f} / {p.p99_ms:.0f} | {len(refused)} | "
                + (f"{r.p50_ms:.0f} / {r.p99_ms:.0f}" if refused else "–")
                + f" | {len(late)} | {other} |")
    result.summary += [
        "",
        f"- `{SHEDDING_PIPELINE}` is `pipeline` with its queue policy's `max_queue_size` "
        f"{shedding.batching.max_queue_size}: sized so that what it admits is answered in about "
        "a second here. "
        "Beyond that it refuses at once, and what it admits keeps its latency. A refusal is not "
        "free: Triton still reads the 150 KB request, and here the retrying clients share the "
        "server's 2 cores.",
        f"- The committed `pipeline` admits {_admission(S.PIPELINE)} (sized for a GPU host): "
        "here, a thousand "
        "clients all wait, and what cannot be answered within the deadline fails late instead of "
        "being refused early. Size admission as throughput x acceptable wait "
        "(docs/configuration.md)."]
    result.plot = {"kind": "curve", "title": "Overload: answered/s vs p95 of answered requests"}
    return result
