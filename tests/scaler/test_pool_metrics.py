"""strata:pool_* series follow the pools: a retired pool's series and a deployment that left a
pool go away instead of staying at their last value."""

from prometheus_client import CollectorRegistry, generate_latest

from services.scaler.service import PoolMetrics
from shared.protocol import PoolReport


def series(registry: CollectorRegistry) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in generate_latest(registry).decode().splitlines()
            if line.startswith("strata:pool_") and "_created" not in line}


def test_series_of_retired_pools_and_departed_deployments_go_away():
    registry = CollectorRegistry()
    metrics = PoolMetrics(registry)
    metrics.update([PoolReport("cheap", capacity=1, used=1, cost_per_hour=2.0, deployments={"llm": 1}),
                    PoolReport("dear", capacity=2, used=1, refusals=1, deployments={"llm": 1})],
                   short={"llm": 0}, wanted={"llm": 2})
    before = series(registry)
    assert 'strata:pool_deployment_replicas{deployment="llm",pool="dear"}' in before
    assert 'strata:pool_cost_per_hour{pool="cheap"}' in before
    metrics.update([PoolReport("cheap", capacity=1, used=1, deployments={"llm": 1})], short={}, wanted={})
    after = series(registry)
    assert not any('pool="dear"' in s and "refusals" not in s for s in after), after
    assert 'strata:pool_deployment_replicas{deployment="llm",pool="cheap"}' in after
    assert not any(s.startswith(("strata:pool_wanted_replicas", "strata:pool_short_replicas")) for s in after)
    assert 'strata:pool_refusals_total{pool="dear"}' in after  # a counter: what happened stays counted
