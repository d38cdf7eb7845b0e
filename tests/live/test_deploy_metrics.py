"""Every Triton metric the Kubernetes autoscaler rules and the Grafana dashboard use is one this
Triton release exports (GPU metrics excepted: no GPU here), and the reason the dashboard reads
the orchestrators' own bls_* series for them holds on this release."""

from __future__ import annotations

import re

from tests.helpers import (
    GPU_ONLY,
    eventually,
    image,
    metric,
    metrics_text,
    referenced_metrics,
    settled,
    timed_infer,
)

FAILING = 3


def test_every_triton_metric_the_deployment_uses_is_exported(server):
    exported = set(re.findall(r"^(nv_[a-z_]+)", metrics_text(server), flags=re.MULTILINE))
    used = {m for m in referenced_metrics() if m.startswith("nv_")}
    assert used, "the deployment uses no Triton metric?"
    assert used - GPU_ONLY <= exported, sorted(used - GPU_ONLY - exported)


def test_triton_counts_a_failed_orchestrator_request_a_success_and_bls_a_failure(server,
                                                                                 grpc_client):
    """r24.10's PbMetricReporter reports an orchestrator's request when execute() hands it off,
    before its answer: a request its client gets an error for is a success to Triton. Were this
    to change, the dashboard's and the adapter's orchestrator queries could go back to Triton's
    counters (docs/operations.md, "Triton's own counters and the orchestrators")."""
    model = "pipeline_faulty"

    def failed_bls() -> float:
        return metric(server, "bls_requests_total", model=model) - metric(
            server, "bls_requests_total", model=model, code="SUCCESS")

    bls_before = settled(server, "bls_requests_total", model=model)
    bls_failed_before = failed_bls()
    triton_failed = metric(server, "nv_inference_request_failure", model=model)
    triton_succeeded = metric(server, "nv_inference_request_success", model=model)
    for i in range(FAILING):
        outcome = timed_infer(grpc_client, "grpc", model, image(40 + i),
                              request_id="fault_embedder:error:disk on fire")
        assert outcome.error is not None, "the fault stand-in should have failed the request"
    eventually(server, "bls_requests_total", bls_before + FAILING, model=model)
    assert failed_bls() - bls_failed_before == FAILING
    assert metric(server, "nv_inference_request_failure", model=model) == triton_failed
    assert metric(server, "nv_inference_request_success", model=model) == (
        triton_succeeded + FAILING)
