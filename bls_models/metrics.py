"""The orchestrators' Prometheus metrics, served by Triton's metrics endpoint next to ``nv_*``.

All families are declared here, once, with names starting ``bls_``; every metric is labelled
with the orchestrator's ``model`` name. The families are created through
``pb_utils.MetricFamily`` (passed in, so this module imports without Triton).

Each pb_utils metric call is an IPC round trip to the Triton process, and a request made 13 of
them: counters and gauges are therefore added up here and published by ``flush()`` (the runtime
calls it every ``FLUSH_SECONDS``, and at shutdown), one call per changed series. Histogram
observations cannot be merged through pb_utils and are sent as they come. All calls happen under
the runtime's pb_utils lock.
"""

from __future__ import annotations

from bls_models.errors import Code, Kind

FLUSH_SECONDS = 0.2  # how stale a scraped counter or gauge may be
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GROUP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
BUCKETS = {"bls_coalesced_group_size": GROUP_BUCKETS}  # other histograms: LATENCY_BUCKETS

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
    "bls_coalesced_group_size": (
        "HISTOGRAM", "Requests per sub-request sent to a stage, with coalescing on"),
    "bls_inflight_subrequests": (
        "GAUGE", "Sub-requests sent to a sub-model and not yet answered, abandoned ones "
                 "included (at most subrequest_threads per instance)"),
}


# The codes a request can be answered with: SUCCESS, each error code, or a response that could
# not be sent.
REQUEST_CODES = ("SUCCESS", *(code.value for code in Code), "SEND_FAILED")


def known_series(stages) -> list[tuple[str, dict[str, str]]]:
    """Every (family, labels) an orchestrator with these stages can produce. They are created at
    load, at 0, as Prometheus expects of a known label set: ``rate()`` and dashboards then see
    a series before its first event, not only after it."""
    per_stage = ("bls_stage_latency_seconds", "bls_coalesced_group_size",
                 "bls_deadline_exceeded_total",
                 "bls_abandoned_subrequests_total", "bls_abandoned_subrequests_completed_total",
                 "bls_cancelled_requests_total")
    series = [(family, {}) for family in ("bls_request_latency_seconds", "bls_inflight_requests",
                                          "bls_inflight_subrequests")]
    series += [("bls_requests_total", {"code": code}) for code in REQUEST_CODES]
    for stage in stages:
        series += [(family, {"stage": stage}) for family in per_stage]
        series += [("bls_subrequest_errors_total", {"stage": stage, "kind": kind.value})
                   for kind in Kind]
    return series


class Metrics:
    def __init__(self, pb_utils, model: str, stages=()) -> None:
        self._pb = pb_utils
        self._model = model
        kinds = {"COUNTER": pb_utils.MetricFamily.COUNTER, "GAUGE": pb_utils.MetricFamily.GAUGE,
                 "HISTOGRAM": pb_utils.MetricFamily.HISTOGRAM}
        self._families = {name: pb_utils.MetricFamily(name=name, description=text, kind=kinds[kind])
                          for name, (kind, text) in FAMILIES.items()}
        self._metrics: dict[tuple, object] = {}
        self._pending: dict[tuple, float] = {}  # counter/gauge increments not yet published
        for family, labels in known_series(stages):
            self._metric(family, **labels)

    def _metric(self, family: str, **labels: str):
        key = (family, *sorted(labels.items()))
        metric = self._metrics.get(key)
        if metric is None:
            kwargs = {"labels": {"model": self._model, **labels}}
            if FAMILIES[family][0] == "HISTOGRAM":
                kwargs["buckets"] = list(BUCKETS.get(family, LATENCY_BUCKETS))
            metric = self._metrics[key] = self._families[family].Metric(**kwargs)
        return metric

    def observe(self, family: str, seconds: float, **labels: str) -> None:
        self._metric(family, **labels).observe(seconds)

    def increment(self, family: str, value: float = 1.0, **labels: str) -> None:
        """Counters and gauges: added up locally, published by the next ``flush()``."""
        key = (family, *sorted(labels.items()))
        self._pending[key] = self._pending.get(key, 0.0) + value

    def flush(self) -> int:
        """Publish the pending increments (a gauge's +1/-1 that cancelled out costs nothing).
        Returns the number of pb_utils calls made."""
        pending, self._pending = self._pending, {}
        calls = 0
        for (family, *labels), value in pending.items():
            if value:
                self._metric(family, **dict(labels)).increment(value)
                calls += 1
        return calls

    def close(self) -> None:
        """Publish what is pending; then metrics must go before their families (python backend
        rule)."""
        self.flush()
        self._metrics.clear()
        self._families.clear()
