"""The orchestrators' Prometheus metrics, served by Triton's metrics endpoint next to ``nv_*``.

All families are declared here, once, with names starting ``bls_``; every metric is labelled
with the orchestrator's ``model`` name. They are registered and published through
``backend.Backend`` (passed in, so this module imports without Triton).

Each pb_utils metric call is an IPC round trip to the Triton process (``Stub::SendMessage`` waits
for the server's answer, r24.10 ``metric.cc``), and a request used to make 13 of them. Nothing is
therefore sent per event:

* counters and gauges are added up here and published by ``flush()`` (the runtime calls it every
  ``FLUSH_SECONDS``, and at shutdown), one call per changed series;
* histograms are kept here too, and published every ``HISTOGRAM_FLUSH_SECONDS`` as the series a
  Prometheus histogram exposes: ``<name>_bucket{le=...}`` (cumulative), ``<name>_sum`` and
  ``<name>_count``. pb_utils can only ``observe`` a histogram one value at a time, so these are
  counter families: the samples are the same lines a histogram has, ``histogram_quantile()``
  reads them as it reads a histogram's, and only the ``# TYPE`` line says counter. Measured
  (``python -m bench.profile pipeline --concurrency 16 --stubs none``): observing per event cost
  0.5 ms of the stub's CPU and ~1 ms of tritonserver's per request.

Only ``flush`` and ``close`` reach the server; ``increment`` and ``observe`` are local and
thread-safe.
"""

from __future__ import annotations

import bisect
import math
import threading
import traceback

from bls_models.errors import Code, Kind

FLUSH_SECONDS = 0.2  # how stale a scraped counter or gauge may be
# How stale a scraped histogram may be. Each publication costs one call per changed bucket
# (cumulative buckets: an observation changes every bucket above it), about 75 for `pipeline`
# under load, so histograms go out less often than counters; Prometheus scrapes every 15 s or so.
HISTOGRAM_FLUSH_SECONDS = 5.0
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
BUCKETS = {"bls_subrequest_rows": ROW_BUCKETS}  # other histograms: LATENCY_BUCKETS

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
        "COUNTER", "Requests whose deadline or stage timeout passed, by the stage they waited on"),
    "bls_abandoned_subrequests_total": (
        "COUNTER", "Sub-requests given up on after their deadline while still running"),
    "bls_abandoned_subrequests_completed_total": (
        "COUNTER", "Abandoned sub-requests that have since finished (their result is dropped)"),
    "bls_cancelled_requests_total": (
        "COUNTER", "Requests cancelled by the client, by the stage they were stopped before"),
    "bls_inflight_requests": (
        "GAUGE", "Requests being orchestrated right now"),
    "bls_subrequest_rows": (
        "HISTOGRAM", "Rows per sub-request sent to a stage (a group's stacked requests)"),
    "bls_isolated_requests_total": (
        "COUNTER", "Requests re-run alone because their group failed with an error one request "
                   "may cause"),
    "bls_isolation_reused_subrequests_total": (
        "COUNTER", "Sub-requests a request re-run alone took from its group's answer instead of "
                   "sending (isolation.Memo)"),
    "bls_inflight_subrequests": (
        "GAUGE", "Sub-requests sent to a sub-model and not yet answered, abandoned ones "
                 "included (at most subrequest_threads per instance)"),
}


# The codes a request can be answered with: SUCCESS, each error code, or a response that could
# not be sent.
REQUEST_CODES = ("SUCCESS", *(code.value for code in Code), "SEND_FAILED")


def le(bound: float) -> str:
    """A bucket's ``le`` label as Prometheus writes it."""
    return "+Inf" if math.isinf(bound) else f"{bound:.16g}"  # 0.0025, 1, 10


# Each histogram family's bucket upper bounds, ``+Inf`` last (computed once: ``observe`` is on
# every request's path).
_BOUNDS = {family: (*BUCKETS.get(family, LATENCY_BUCKETS), math.inf)
           for family, (kind, _) in FAMILIES.items() if kind == "HISTOGRAM"}


def bounds(family: str) -> tuple[float, ...]:
    """A histogram family's bucket upper bounds, ``+Inf`` last."""
    return _BOUNDS[family]


def exposed(family: str) -> list[tuple[str, str]]:
    """The families Triton gets for one of ``FAMILIES``: (name, kind). A histogram is published
    as its three sample families (see the module docstring)."""
    kind, _ = FAMILIES[family]
    if kind != "HISTOGRAM":
        return [(family, kind)]
    return [(f"{family}_bucket", "COUNTER"), (f"{family}_sum", "COUNTER"),
            (f"{family}_count", "COUNTER")]


def known_series(stages) -> list[tuple[str, dict[str, str]]]:
    """Every (family, labels) an orchestrator with these stages can produce. They are created at
    load, at 0, as Prometheus expects of a known label set: ``rate()`` and dashboards then see
    a series before its first event, not only after it."""
    per_stage = ("bls_stage_latency_seconds", "bls_subrequest_rows",
                 "bls_deadline_exceeded_total",
                 "bls_abandoned_subrequests_total", "bls_abandoned_subrequests_completed_total",
                 "bls_cancelled_requests_total", "bls_isolation_reused_subrequests_total")
    series = [(family, {}) for family in ("bls_request_latency_seconds", "bls_inflight_requests",
                                          "bls_inflight_subrequests",
                                          "bls_isolated_requests_total")]
    series += [("bls_requests_total", {"code": code}) for code in REQUEST_CODES]
    for stage in stages:
        series += [(family, {"stage": stage}) for family in per_stage]
        series += [("bls_subrequest_errors_total", {"stage": stage, "kind": kind.value})
                   for kind in Kind]
    return series


class _Observations:
    """A histogram series' observations not yet published: per-bucket counts and their sum."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.total = 0.0


class Metrics:
    """The families and series of one orchestrator instance.

    ``increment`` and ``observe`` only add to what is pending, under this object's own lock, from
    any thread; they never reach the server. ``flush`` publishes (one pb_utils round trip per
    changed series) with no lock held. A publication that fails keeps what it could not publish
    for the next flush: nothing is lost, and what is kept is bounded by the number of series."""

    def __init__(self, backend, model: str, stages=(), stub: str = "") -> None:
        self._backend = backend
        # Every series also names its stub (``stub_pid``), so no two stubs share one: r24.10
        # frees a series when one of the MetricFamily objects that made it lets it go, and a
        # stub still counting on it corrupts the server's heap (seen at every stop with two
        # instances: "malloc_consolidate(): unaligned fastbin chunk detected", Signal 6).
        self._labels = {"model": model, **({"stub_pid": stub} if stub else {})}
        self._families = {
            name: backend.metric_family(name, FAMILIES[family][1], kind)
            for family in FAMILIES for name, kind in exposed(family)}
        self._metrics: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._pending: dict[tuple, float] = {}  # counter/gauge increments not yet published
        self._observed: dict[tuple, _Observations] = {}  # histograms, not yet published
        self._unsent: dict[tuple, float] = {}  # series increments a failed flush did not publish
        self._watched: dict[tuple, list] = {}  # gauges read when published: [read, published]
        self._due, self._failing = (0.0, 0.0), False  # next flush, next with histograms
        for family, labels in known_series(stages):
            if FAMILIES[family][0] == "HISTOGRAM":
                for bound in bounds(family):
                    self._metric((f"{family}_bucket", *_sorted(labels, le=le(bound))))
                self._metric((f"{family}_sum", *_sorted(labels)))
                self._metric((f"{family}_count", *_sorted(labels)))
            else:
                self._metric((family, *_sorted(labels)))

    def _metric(self, key: tuple):
        """The pb_utils metric of a series ``(name, *sorted labels)``, created on first use."""
        metric = self._metrics.get(key)
        if metric is None:
            name, *labels = key
            metric = self._metrics[key] = self._backend.metric(
                self._families[name], {**self._labels, **dict(labels)})
        return metric

    @staticmethod
    def key(family: str, **labels: str) -> tuple:
        """A series' key, for ``record`` (hot paths compute theirs once)."""
        return (family, *sorted(labels.items()))

    def observe(self, family: str, value: float, **labels: str) -> None:
        """Histograms: kept locally, published by the next ``flush(histograms=True)``."""
        self.record(observations=((self.key(family, **labels), value),))

    def increment(self, family: str, value: float = 1.0, **labels: str) -> None:
        """Counters and gauges: added up locally, published by the next ``flush()``."""
        self.record(increments=((self.key(family, **labels), value),))

    def record(self, increments=(), observations=()) -> None:
        """Counter and gauge increments and histogram observations, ``(key, value)`` each,
        under one lock."""
        with self._lock:
            for key, value in increments:
                self._pending[key] = self._pending.get(key, 0.0) + value
            for key, value in observations:
                limits = _BOUNDS[key[0]]
                pending = self._observed.get(key)
                if pending is None:
                    pending = self._observed[key] = _Observations(len(limits))
                # The first bucket whose bound is >= value (Prometheus' `le`); +Inf the rest.
                pending.counts[bisect.bisect_left(limits, value)] += 1
                pending.total += value

    def watch(self, family: str, read, **labels: str) -> None:
        """A gauge whose value is ``read()`` when published: nothing is counted per event."""
        self._watched[self.key(family, **labels)] = [read, 0.0]

    def pending(self, family: str, **labels: str) -> float:
        """What the series of ``family`` whose labels include ``labels`` have not published
        yet, summed (e.g. a gauge's drift while publication fails)."""
        wanted = set(labels.items())
        with self._lock:
            watched = {key: read() - published
                       for key, (read, published) in self._watched.items()}
            return sum(value for store in (self._pending, self._unsent, watched)
                       for (name, *found), value in store.items()
                       if name == family and wanted <= set(found))

    def flush(self, histograms: bool = False) -> int:
        """Publish the pending increments (a gauge's +1/-1 that cancelled out costs nothing),
        and with ``histograms`` the pending observations. Returns the number of pb_utils calls
        made; raises what a call raised, after keeping everything it did not publish."""
        with self._lock:
            series, self._unsent = self._unsent, {}
            pending, self._pending = self._pending, {}
            observed, self._observed = (self._observed, {}) if histograms else ({}, self._observed)
        for key, value in pending.items():
            _add(series, key, value)
        for key, watched in self._watched.items():
            value = float(watched[0]())
            _add(series, key, value - watched[1])
            watched[1] = value
        for (family, *labels), values in observed.items():
            cumulative = 0
            for bound, count in zip(bounds(family), values.counts):
                cumulative += count
                if cumulative:
                    _add(series, (f"{family}_bucket", *_sorted(dict(labels), le=le(bound))),
                         cumulative)
            _add(series, (f"{family}_sum", *labels), values.total, always=True)
            _add(series, (f"{family}_count", *labels), cumulative, always=True)
        calls = 0
        items = list(series.items())
        for index, (key, value) in enumerate(items):
            try:
                self._backend.increment(self._metric(key), value)
            except BaseException:
                with self._lock:
                    for unsent, rest in items[index:]:
                        _add(self._unsent, unsent, rest, always=True)
                raise
            calls += 1
        return calls

    def publish(self, now: float, log) -> None:
        """(the runtime's clock) ``flush`` when due: counters and gauges every FLUSH_SECONDS,
        histograms every HISTOGRAM_FLUSH_SECONDS; a failure is logged when it starts, and what
        was not published goes with the next flush."""
        if now < self._due[0]:
            return
        histograms = now >= self._due[1]
        try:
            self.flush(histograms=histograms)
            if self._failing:
                self._failing = False
                log("publishing metrics works again")
        except Exception:  # noqa: BLE001 - logged when it starts failing, not every time
            if not self._failing:
                self._failing = True
                log(f"publishing metrics failed (retried every {FLUSH_SECONDS} s):\n"
                    f"{traceback.format_exc()}", error=True)
        self._due = (now + FLUSH_SECONDS,
                     now + HISTOGRAM_FLUSH_SECONDS if histograms else self._due[1])

    def close(self) -> None:
        """Publish what is pending; then metrics must go before their families (python backend
        rule), whether or not the publication worked."""
        try:
            self.flush(histograms=True)
        finally:
            self._backend.clear(self._metrics, self._families)


def _sorted(labels: dict[str, str], **more: str) -> tuple:
    return tuple(sorted({**labels, **more}.items()))


def _add(series: dict[tuple, float], key: tuple, value: float, always: bool = False) -> None:
    """Add ``value`` to a series' increment (a zero is left out unless ``always``: a histogram's
    sum and count are published with every publication of the histogram)."""
    if value or always:
        series[key] = series.get(key, 0.0) + value
