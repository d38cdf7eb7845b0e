"""Metrics batching (pure logic, with a recording stand-in for pb_utils' metric classes)."""

from bls_models.metrics import FAMILIES, Metrics


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

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
        return _Recorded(self.log, (self.name, tuple(sorted(labels.items()))))


class _PbUtils:
    def __init__(self):
        self.log = []
        log = self.log

        class Family(_Family):
            def __init__(self, name, description, kind):
                super().__init__(name, description, kind, log)

        self.MetricFamily = Family


def test_counters_and_gauges_wait_for_flush_one_call_per_series():
    pb = _PbUtils()
    metrics = Metrics(pb, "pipeline")
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
    metrics = Metrics(pb, "pipeline")
    metrics.increment("bls_inflight_requests", +1)
    metrics.increment("bls_inflight_requests", +1)
    metrics.increment("bls_inflight_requests", -1)
    assert metrics.flush() == 1
    assert pb.log[-1][2] == 1
    metrics.increment("bls_inflight_requests", +1)
    metrics.increment("bls_inflight_requests", -1)
    assert metrics.flush() == 0


def test_histograms_are_sent_at_once_and_close_flushes():
    pb = _PbUtils()
    metrics = Metrics(pb, "pipeline")
    metrics.observe("bls_request_latency_seconds", 0.012)
    assert pb.log == [("observe", ("bls_request_latency_seconds", (("model", "pipeline"),)), 0.012)]
    metrics.increment("bls_cancelled_requests_total", stage="classifier")
    metrics.close()
    assert pb.log[-1][0] == "increment" and pb.log[-1][2] == 1


def test_every_family_is_declared_once_with_the_prefix():
    assert all(name.startswith("bls_") for name in FAMILIES)
