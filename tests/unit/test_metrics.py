"""Metrics batching (pure logic, with a recording stand-in for pb_utils' metric classes), and the
series the runtime counts against those it declares at load."""

import math
import time

from bls_models.backend import Backend
from bls_models.errors import Code, Kind
from bls_models.metrics import FAMILIES, LATENCY_BUCKETS, Metrics, exposed, known_series
from bls_models.spec import REQUEST_CODES


class _Recorded:
    def __init__(self, log, labels):
        self.log, self.labels = log, labels

    def increment(self, value):
        self.log.append(("increment", self.labels, value))

    def observe(self, value):
        self.log.append(("observe", self.labels, value))


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind, log=None):
        self.name, self.log = name, log

    def Metric(self, labels, buckets=None):
        self.created.append((self.name, tuple(sorted(labels.items()))))
        return _Recorded(self.log, (self.name, tuple(sorted(labels.items()))))


class _PbUtils:
    TRITONSERVER_MEMORY_CPU = 0

    @staticmethod
    def PreferredMemory(kind, device):
        return (kind, device)

    def __init__(self):
        self.log = []
        self.created = []
        log, created = self.log, self.created

        class Family(_Family):
            def __init__(self, name, description, kind):
                super().__init__(name, description, kind, log)
                self.created = created

        self.MetricFamily = Family


def test_counters_and_gauges_wait_for_flush_one_call_per_series():
    pb = _PbUtils()
    metrics = Metrics(Backend(pb, "pipeline"), "pipeline")
    for _ in range(100):
        metrics.increment("bls_requests_total", code="SUCCESS")
    metrics.increment("bls_requests_total", code="INTERNAL")
    assert pb.log == [], "nothing may cross to Triton before flush"
    assert metrics.flush() == 2
    published = {labels: value for _, labels, value in pb.log}
    assert published[("bls_requests_total", (("code", "SUCCESS"), ("model", "pipeline")))] == 100
    assert published[("bls_requests_total", (("code", "INTERNAL"), ("model", "pipeline")))] == 1
    assert metrics.flush() == 0, "a second flush publishes nothing new"


def test_a_gauge_that_went_up_and_down_costs_no_call():
    pb = _PbUtils()
    metrics = Metrics(Backend(pb, "pipeline"), "pipeline")
    metrics.increment("bls_inflight_requests", +1)
    metrics.increment("bls_inflight_requests", +1)
    metrics.increment("bls_inflight_requests", -1)
    assert metrics.flush() == 1
    assert pb.log[-1][2] == 1
    metrics.increment("bls_inflight_requests", +1)
    metrics.increment("bls_inflight_requests", -1)
    assert metrics.flush() == 0


def _published(pb) -> dict:
    """What the increments so far add up to: (name, labels) -> value."""
    totals = {}
    for _, key, value in pb.log:
        totals[key] = totals.get(key, 0) + value
    return totals


def test_histograms_wait_for_their_flush_and_publish_prometheus_series():
    pb = _PbUtils()
    metrics = Metrics(Backend(pb, "pipeline"), "pipeline", stages=["classifier"])
    for seconds in (0.0004, 0.012, 0.012, 0.3, 99.0):  # 99 s: above the last bound
        metrics.record(observations=[(metrics.key("bls_request_latency_seconds"), seconds)])
    stage = metrics.key("bls_stage_latency_seconds", stage="classifier")
    metrics.record(observations=[(stage, 0.001)])  # on a bound: le
    assert pb.log == [] and metrics.flush() == 0, "observations go out with the histograms only"
    calls = metrics.flush(histograms=True)
    assert all(kind == "increment" for kind, _, _ in pb.log), "no per-value observe call"
    model = ("model", "pipeline")

    def bucket(bound, *labels, family="bls_request_latency_seconds"):
        return (f"{family}_bucket", tuple(sorted([model, ("le", bound), *labels])))

    totals = _published(pb)
    # Cumulative, as Prometheus' `le` buckets are: each counts every value at or below it.
    expected = {0.001: 1, 0.0025: 1, 0.01: 1, 0.025: 3, 0.25: 3, 0.5: 4, 10.0: 4}
    for bound, count in expected.items():
        assert totals[bucket(f"{bound:.16g}")] == count, bound
    assert totals[bucket("+Inf")] == 5
    assert totals[("bls_request_latency_seconds_count", (model,))] == 5
    assert math.isclose(totals[("bls_request_latency_seconds_sum", (model,))], 99.3244)
    stage = ("stage", "classifier")
    assert totals[bucket("0.001", stage, family="bls_stage_latency_seconds")] == 1
    assert calls == len(pb.log)
    assert metrics.flush(histograms=True) == 0, "a second flush publishes nothing new"


def test_a_histogram_series_exposes_every_bucket_at_zero_from_load():
    pb = _PbUtils()
    Metrics(Backend(pb, "pipeline"), "pipeline")
    buckets = {dict(labels)["le"] for name, labels in pb.created
               if name == "bls_request_latency_seconds_bucket"}
    assert buckets == {f"{b:.16g}" for b in LATENCY_BUCKETS} | {"+Inf"}
    assert ("bls_request_latency_seconds_count", (("model", "pipeline"),)) in pb.created


def test_close_publishes_what_is_pending():
    pb = _PbUtils()
    metrics = Metrics(Backend(pb, "pipeline"), "pipeline")
    metrics.record(observations=[(metrics.key("bls_request_latency_seconds"), 0.012)])
    metrics.increment("bls_cancelled_requests_total", stage="classifier")
    metrics.close()
    totals = _published(pb)
    assert totals[("bls_request_latency_seconds_count", (("model", "pipeline"),))] == 1
    assert totals[("bls_cancelled_requests_total",
                   (("model", "pipeline"), ("stage", "classifier")))] == 1


def test_every_family_is_declared_once_with_the_prefix():
    assert all(name.startswith("bls_") for name in FAMILIES)


def test_every_known_series_exists_at_zero_from_load():
    pb = _PbUtils()
    Metrics(Backend(pb, "pipeline"), "pipeline", stages=["preprocess", "classifier"])
    created = set(pb.created)
    assert pb.log == [], "creating a series publishes no value: it starts at 0"
    assert len(created) == len(pb.created), "a series was created twice"
    model = ("model", "pipeline")
    for kind in Kind:
        assert ("bls_subrequest_errors_total",
                tuple(sorted([model, ("stage", "classifier"), ("kind", kind.value)]))) in created
    for code in (*(c.value for c in Code), "SUCCESS"):
        assert ("bls_requests_total", tuple(sorted([model, ("code", code)]))) in created
    assert ("bls_deadline_exceeded_total", tuple(sorted([model, ("stage", "preprocess")]))) in created
    assert {name for name, _ in created} == {name for family in FAMILIES
                                             for name, _ in exposed(family)}, \
        "a family has no series at load"


def test_known_series_cover_what_the_runtime_counts():
    series = known_series(["s"])
    assert ("bls_requests_total", {"code": "SEND_FAILED"}) in series
    assert set(REQUEST_CODES) >= {"SUCCESS", "CANCELLED", "INTERNAL", "UNAVAILABLE", "INVALID_ARG"}
    # Counting a known series later reuses it: no second Metric object.
    pb = _PbUtils()
    metrics = Metrics(Backend(pb, "pipeline"), "m", stages=["s"])
    before = len(pb.created)
    metrics.increment("bls_cancelled_requests_total", stage="s")
    metrics.flush()
    assert len(pb.created) == before


def test_every_series_the_runtime_counts_was_created_at_load():
    """A burst that meets isolation (and its re-used sub-requests), a deadline with abandoned
    sub-requests, a stage timeout and a cancellation: once finalize has published everything,
    no series exists that the orchestrator did not create at load (a label value it counts is
    one ``known_series`` lists, so dashboards see every series from the start)."""
    from tests.helpers import orchestrator
    from tests.unit.fake_pb_utils import FakePbUtils, Request
    from tests.unit.row_models import POISON, DirectedRowModels, image_of

    pb = FakePbUtils(DirectedRowModels(poisoned_stages=("embedder",)).models())
    orch = orchestrator(pb, embedder_timeout_ms="150")
    at_load = set(pb.metrics)
    cancelled = Request(image_of(5), request_id="c;preprocess=250")
    cancelled.sender.cancelled.set()  # asked, and answered, once its batch is 0.1 s old
    try:
        pb.execute(orch, [Request(image_of(v), request_id=f"i{v}") for v in (20, POISON, 22)])
        pb.execute(orch, [Request(image_of(1), request_id="d;classifier=250",
                                  timeout_us=100_000)])
        pb.execute(orch, [Request(image_of(2), request_id="t;embedder=250")])
        pb.execute(orch, [cancelled])
        time.sleep(0.3)  # the abandoned sub-requests come back
    finally:
        pb.finalize(orch)
    assert set(pb.metrics) == at_load
    for family in ("bls_isolated_requests_total", "bls_isolation_reused_subrequests_total",
                   "bls_deadline_exceeded_total", "bls_abandoned_subrequests_completed_total",
                   "bls_cancelled_requests_total", "bls_request_latency_seconds_count",
                   "bls_subrequest_rows_count"):
        assert pb.metric(family) > 0, f"the burst never counted {family}"
    assert pb.check() == []
