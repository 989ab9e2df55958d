"""/metrics?since=: counters and histograms over the window, gauges as they are now."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics_history import MetricsHistory


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def values(text: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_a_window_is_the_difference_from_the_snapshot_that_old():
    r = CollectorRegistry()
    requests = Counter("strata:requests", "", ["model_name"], registry=r)
    latency = Histogram("strata:latency_seconds", "", buckets=(0.1, 1.0), registry=r)
    running = Gauge("strata:running", "", registry=r)
    clock = Clock()
    history = MetricsHistory(r, interval=10, keep=30, clock=clock)
    for t in range(4):  # snapshots at 1000, 1010, 1020, 1030 (the first one falls out: keep 30 s)
        requests.labels("a").inc(10)
        latency.observe(0.05)
        history.snapshot()
        clock.now += 10
    requests.labels("b").inc(3)  # a series younger than every snapshot
    latency.observe(0.5)
    running.set(7)
    clock.now = 1035.0

    text, window = history.exposition(since=20)  # the newest snapshot at least 20 s old: 1010
    v = values(text)
    assert window == 25.0
    assert v[("strata:requests_total", (("model_name", "a"),))] == 20  # 40 now, 20 at 1010
    assert v[("strata:requests_total", (("model_name", "b"),))] == 3
    assert v[("strata:latency_seconds_count", ())] == 3
    assert v[("strata:latency_seconds_bucket", (("le", "0.1"),))] == 2
    assert v[("strata:latency_seconds_bucket", (("le", "1.0"),))] == 3
    assert abs(v[("strata:latency_seconds_sum", ())] - 0.6) < 1e-9
    assert v[("strata:running", ())] == 7  # a gauge is what it is now

    text, window = history.exposition(since=0)  # totals since the process started
    assert values(text)[("strata:requests_total", (("model_name", "a"),))] == 40 and window == 35.0
    text, window = history.exposition(since=3600)  # older than the memory: totals, and says so
    assert values(text)[("strata:requests_total", (("model_name", "a"),))] == 40 and window == 35.0
