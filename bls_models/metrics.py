"""The orchestrators' Prometheus metrics, served by Triton's metrics endpoint next to ``nv_*``.

Families are declared in ``spec.FAMILIES``, labelled with the ``model`` and its stub's pid.
Each pb_utils metric call is an IPC round trip: nothing is sent per event; what is added up here
is published from a thread of its own, one call per changed series, a histogram as the counter
series Prometheus exposes (``_bucket{le=...}``, ``_sum``, ``_count``).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
import traceback

from bls_models.spec import FAMILIES, LATENCY_BUCKETS, ROW_BUCKETS, known_series

FLUSH_SECONDS = 0.2            # how stale a scraped counter or gauge may be
HISTOGRAM_FLUSH_SECONDS = 5.0  # and a histogram (each publication: a call per changed bucket)
_BOUNDS = {family: (*(ROW_BUCKETS if family == "bls_subrequest_rows" else LATENCY_BUCKETS),
                    math.inf) for family, (kind, _) in FAMILIES.items() if kind == "HISTOGRAM"}


def le(bound: float) -> str:
    """A bucket's ``le`` label as Prometheus writes it."""
    return "+Inf" if math.isinf(bound) else f"{bound:.16g}"


def exposed(family: str) -> list[tuple[str, str]]:
    """The families Triton gets for one of ``FAMILIES``: (name, kind)."""
    kind = FAMILIES[family][0]
    if kind != "HISTOGRAM":
        return [(family, kind)]
    return [(f"{family}{part}", "COUNTER") for part in ("_bucket", "_sum", "_count")]


class Metrics:
    """One orchestrator instance's series. ``increment`` and ``record`` add to what
    is pending, under this object's lock, from any thread; ``flush`` publishes it with no lock
    held, and keeps for the next flush whatever a failed publication did not send."""

    def __init__(self, backend, model: str, stages=(), stub: str = "") -> None:
        self._backend = backend
        # Every series also names its stub (``stub_pid``), so no two stubs share one: r24.10
        # frees a series when one of the MetricFamily objects that made it lets it go, and a
        # stub still counting on it corrupts the server's heap (seen at every stop with two
        # instances: "malloc_consolidate(): unaligned fastbin chunk detected", Signal 6).
        self._labels = {"model": model, **({"stub_pid": stub} if stub else {})}
        self._families = {name: backend.metric_family(name, FAMILIES[family][1], kind)
                          for family in FAMILIES for name, kind in exposed(family)}
        self._metrics: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._pending: dict[tuple, float] = {}   # counter and gauge increments
        self._observed: dict[tuple, list] = {}   # histogram series -> [bucket counts..., sum]
        self._unsent: dict[tuple, float] = {}    # what a failed publication did not send
        self._watched: dict[tuple, list] = {}    # gauges read when published: [read, published]
        self._thread, self._stop = None, threading.Event()  # ``start``'s
        for family, labels in known_series(stages):
            histogram = FAMILIES[family][0] == "HISTOGRAM"
            for bound in _BOUNDS[family] if histogram else ():
                self._metric((f"{family}_bucket", *_sorted(labels, le=le(bound))))
            for name in (f"{family}_sum", f"{family}_count") if histogram else (family,):
                self._metric((name, *_sorted(labels)))

    def _metric(self, key: tuple):
        """The pb_utils metric of a series ``(name, *sorted labels)``, made on first use."""
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

    def increment(self, family: str, value: float = 1.0, **labels: str) -> None:
        self.record(increments=((self.key(family, **labels), value),))

    def record(self, increments=(), observations=()) -> None:
        """Increments and histogram observations, ``(key, value)`` each, under one lock."""
        with self._lock:
            for key, value in increments:
                self._pending[key] = self._pending.get(key, 0.0) + value
            for key, value in observations:
                limits = _BOUNDS[key[0]]
                counts = self._observed.get(key)
                if counts is None:
                    counts = self._observed[key] = [0] * len(limits) + [0.0]
                counts[bisect.bisect_left(limits, value)] += 1  # the first bound >= value
                counts[-1] += value

    def watch(self, family: str, read, **labels: str) -> None:
        """A gauge whose value is ``read()`` when published: nothing is counted per event."""
        self._watched[self.key(family, **labels)] = [read, 0.0]

    def flush(self, histograms: bool = False) -> int:
        """Publish the pending increments (and, with ``histograms``, observations); returns the
        calls made. Raises what a call raised, after keeping what it did not publish."""
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
        for (family, *labels), counts in observed.items():
            cumulative = 0
            for bound, count in zip(_BOUNDS[family], counts):
                cumulative += count
                if cumulative:
                    _add(series, (f"{family}_bucket", *_sorted(dict(labels), le=le(bound))),
                         cumulative)
            _add(series, (f"{family}_sum", *labels), counts[-1], always=True)
            _add(series, (f"{family}_count", *labels), cumulative, always=True)
        items = list(series.items())
        for index, (key, value) in enumerate(items):
            try:
                self._backend.increment(self._metric(key), value)
            except BaseException:
                with self._lock:
                    for unsent, rest in items[index:]:
                        _add(self._unsent, unsent, rest, always=True)
                raise
        return len(items)

    def start(self, name: str) -> None:
        """Publish from a thread of its own until ``close``: every FLUSH_SECONDS, histograms
        every HISTOGRAM_FLUSH_SECONDS; a failure is logged when it starts, not every time."""
        self._thread = threading.Thread(target=self._publish, daemon=True, name=name)
        self._thread.start()

    def _publish(self) -> None:
        log, failing = self._backend.log, False
        histograms_due = time.monotonic() + HISTOGRAM_FLUSH_SECONDS
        while not self._stop.wait(FLUSH_SECONDS):
            histograms = time.monotonic() >= histograms_due
            try:
                self.flush(histograms=histograms)
                failing = False
            except Exception:  # noqa: BLE001 - what was not published goes with the next flush
                if not failing:
                    log(f"publishing metrics failed (retried every {FLUSH_SECONDS} s):\n"
                        f"{traceback.format_exc()}", error=True)
                failing = True
            if histograms:
                histograms_due = time.monotonic() + HISTOGRAM_FLUSH_SECONDS

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread (waiting up to ``timeout`` s), publish what is pending; then metrics
        go before their families (a python backend rule), whether or not that worked."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.flush(histograms=True)
        finally:
            self._backend.clear(self._metrics, self._families)


def _sorted(labels: dict[str, str], **more: str) -> tuple:
    return tuple(sorted({**labels, **more}.items()))


def _add(series: dict[tuple, float], key: tuple, value: float, always: bool = False) -> None:
    """Add ``value`` to a series' increment (a zero only if ``always``)."""
    if value or always:
        series[key] = series.get(key, 0.0) + value
