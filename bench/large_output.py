"""`make bench-large_output`: the tagger's 28.7 MB output per sequence at concurrency 1 — over
HTTP, gRPC and system shared memory, reduced in the ONNX graph or in the orchestrator, with two
batching delays — against the same work in-process."""

from __future__ import annotations

import numpy as np

from bench import clients, perf
from bench.common import Context, Result, target_line
from bench.repository import LOGITS_TAG_PIPELINE
from bls_models import pipelines
from bls_models import spec as S
from tritonlocal import flags

SHM_OUTPUT_BYTES = 4 * 512 * 14041 + 1024  # one tagger output (28.7 MB) for perf_analyzer's shm


def large_output(ctx: Context) -> Result:
    result = Result("large_output", "The large-output case (tagger, 28.7 MB per sequence), concurrency 1")
    url_grpc, url_http = ctx.server.grpc_url, ctx.server.http_url
    # Token 0 is valid (random INT64 would not be); TOKENS is [-1]: 512-token documents.
    zero = ["--input-data", "zero", "--shape", f"TOKENS:{S.TAGGER_SEQ_LEN}"]
    # Registering regions is an admin API: the credential goes along, over HTTP, as perf_analyzer
    # 2.51 sends no headers over gRPC (reports print it redacted: perf.Run.command_line).
    credential = flags.header_line(next(iter(ctx.server.admin_headers.items())))
    shm = ["--shared-memory", "system", "--output-shared-memory-size", str(SHM_OUTPUT_BYTES),
           "-H", credential]
    cases = [
        ("`tagger` over HTTP", "tagger", url_http, "http", zero),
        ("`tagger` over gRPC", "tagger", url_grpc, "grpc", zero),
        ("`tagger` over HTTP + system shared memory", "tagger", url_http, "http", zero + shm),
        ("`tagger_tags` (the reduction in the ONNX graph), gRPC", "tagger_tags", url_grpc, "grpc",
         zero),
        ("`tag_pipeline` over `tagger_tags` (committed), gRPC", "tag_pipeline", url_grpc, "grpc",
         zero),
        ("`tag_pipeline` over `tagger` (logits reduced in the orchestrator), gRPC",
         LOGITS_TAG_PIPELINE, url_grpc, "grpc", zero),
        ("`tagger`, max_queue_delay 100 000 µs, gRPC", "tagger_delay_100ms", url_grpc, "grpc", zero),
        ("`tagger`, max_queue_delay 100 µs, gRPC", "tagger_delay_100us", url_grpc, "grpc", zero),
    ]
    p50 = {}
    for label, model, url, protocol, extra in cases:
        points = result.add_run(label, perf.run(model, url, [1], ctx.settings, protocol=protocol,
                                                extra=extra), protocol=protocol)
        p50[label] = points[0].p50_ms if points else None
    local = clients.InProcess(ctx.repository)
    tokens = np.zeros((1, S.TAGGER_SEQ_LEN), dtype=np.int64)
    inproc = local.measure(lambda: local.tagger(tokens), 1, 1.0 if ctx.quick else 6.0)
    result.add("in-process onnxruntime `tagger`", inproc, protocol="none")
    # The same work tag_pipeline does, without serving: the reduction is not free (it reads all
    # 28.7 MB), so this is the fair baseline for what serving it costs.
    reduced = local.measure(lambda: pipelines.reduce_tags(local.tagger(tokens)), 1,
                            1.0 if ctx.quick else 6.0)
    result.add("in-process `tagger` + the same reduction", reduced, protocol="none")
    in_graph = local.measure(lambda: local.tagger_tags(tokens), 1, 1.0 if ctx.quick else 6.0)
    result.add("in-process `tagger_tags` (reduction in the graph)", in_graph, protocol="none")
    result.summary += ["| case | p50 (ms) | × in-process |", "|---|---|---|"]
    for label in [c[0] for c in cases]:
        if p50[label]:
            result.summary.append(f"| {label} | {p50[label]:.1f} | {p50[label] / inproc.p50_ms:.2f} |")
    result.summary.append(f"| in-process onnxruntime `tagger` | {inproc.p50_ms:.1f} | 1.00 |")
    result.summary.append(f"| in-process `tagger` + the same reduction (numpy) | "
                          f"{reduced.p50_ms:.1f} | {reduced.p50_ms / inproc.p50_ms:.2f} |")
    result.summary.append(f"| in-process `tagger_tags` (the reduction in the ONNX graph) | "
                          f"{in_graph.p50_ms:.1f} | {in_graph.p50_ms / inproc.p50_ms:.2f} |")
    tag = p50.get("`tag_pipeline` over `tagger_tags` (committed), gRPC")
    tag_logits = p50.get("`tag_pipeline` over `tagger` (logits reduced in the orchestrator), gRPC")
    result.summary.append("")
    result.summary.append(target_line("`tag_pipeline` p50 / in-process `tagger` p50",
                                  tag / inproc.p50_ms if tag else None, 1.25, "lower"))
    if tag:
        result.summary.append(
            f"- What serving adds to the same work: `tag_pipeline` / in-process `tagger_tags` = "
            f"**{tag / in_graph.p50_ms:.2f}**; the reduction itself costs "
            f"{in_graph.p50_ms - inproc.p50_ms:.1f} ms in ONNX Runtime "
            f"({in_graph.p50_ms / inproc.p50_ms:.2f}× the logits-only network) and "
            f"{reduced.p50_ms - inproc.p50_ms:.1f} ms in numpy.")
    if tag and tag_logits:
        result.summary.append(
            f"- Reducing in the graph instead of in the orchestrator: p50 {tag_logits:.1f} → "
            f"{tag:.1f} ms (× {tag / tag_logits:.2f}): the 28.7 MB per sequence is no longer "
            "copied out of tritonserver (where the onnxruntime backend computes it) into the "
            "orchestrator's shared-memory region.")
    result.plot = {"kind": "bars", "title": "p50 latency at concurrency 1 (ms)"}
    return result
