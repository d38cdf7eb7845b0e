"""The orchestrators' Prometheus metrics, served by Triton's metrics endpoint next to ``nv_*``.

All families are declared here, once, with names starting ``bls_``; every metric is labelled
with the orchestrator's ``model`` name. The families are created through
``pb_utils.MetricFamily`` (passed in, so this module imports without Triton). Each metric call
is an IPC round trip to the Triton process: callers make them on the runtime's event-loop thread
under its pb_utils lock.
"""

from __future__ import annotations

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# name -> (kind, description)
FAMILIES: dict[str, tuple[str, str]] = {
    "bls_request_latency_seconds": (
        "HISTOGRAM", "Time from receiving a request to sending its response, per orchestrator"),
    "bls_stage_latency_seconds": (
        "HISTOGRAM", "Time a stage's sub-request took (until answered or given up), per stage"),
    "bls_requests_total": (
        "COUNTER", "Requests answered, by status code (SUCCESS or the Triton error code)"),
    "bls_subrequest_errors_total": (
        "COUNTER", "Failed sub-requests, by stage and kind (deadline, queue_full, failed, ...)"),
    "bls_deadline_exceeded_total": (
        "COUNTER", "Requests whose deadline or stage timeout passed, by stage"),
    "bls_abandoned_subrequests_total": (
        "COUNTER", "Sub-requests given up on after their deadline while still running"),
    "bls_abandoned_subrequests_completed_total": (
        "COUNTER", "Abandoned sub-requests that have since finished (their result is dropped)"),
    "bls_cancelled_requests_total": (
        "COUNTER", "Requests cancelled by the client, by the stage they were stopped before"),
    "bls_inflight_requests": (
        "GAUGE", "Requests being orchestrated right now"),
    "bls_inflight_subrequests": (
        "GAUGE", "Sub-requests issued and not yet finished, abandoned ones included"),
}


class Metrics:
    def __init__(self, pb_utils, model: str) -> None:
        self._pb = pb_utils
        self._model = model
        kinds = {"COUNTER": pb_utils.MetricFamily.COUNTER, "GAUGE": pb_utils.MetricFamily.GAUGE,
                 "HISTOGRAM": pb_utils.MetricFamily.HISTOGRAM}
        self._families = {name: pb_utils.MetricFamily(name=name, description=text, kind=kinds[kind])
                          for name, (kind, text) in FAMILIES.items()}
        self._metrics: dict[tuple, object] = {}

    def _metric(self, family: str, **labels: str):
        key = (family, *sorted(labels.items()))
        metric = self._metrics.get(key)
        if metric is None:
            kwargs = {"labels": {"model": self._model, **labels}}
            if FAMILIES[family][0] == "HISTOGRAM":
                kwargs["buckets"] = list(LATENCY_BUCKETS)
            metric = self._metrics[key] = self._families[family].Metric(**kwargs)
        return metric

    def observe(self, family: str, seconds: float, **labels: str) -> None:
        self._metric(family, **labels).observe(seconds)

    def increment(self, family: str, value: float = 1.0, **labels: str) -> None:
        self._metric(family, **labels).increment(value)

    def close(self) -> None:
        """Metrics must go before their families (python backend rule)."""
        self._metrics.clear()
        self._families.clear()
