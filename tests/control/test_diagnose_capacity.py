"""`strata diagnose` names "infrastructure: capacity" when a deployment is short of replicas
because every capacity pool it may use is full or refusing (crafted figures, and the figures
read from a scaler's real /metrics text)."""

from services.control.diagnose import PoolFigures, diagnose, render
from services.control.figures import Samples, _pools
from tests.control.test_diagnose import deployment, engine, figures


def test_a_deployment_short_because_every_pool_is_full_is_infrastructure_capacity():
    saturated = [engine(f"e{i}", concurrency=64, running=64) for i in range(3)]
    d = deployment(saturated, ttft=1.0, admission=0.8)
    d.wanted, d.short = 5, 2
    d.pools = [PoolFigures("spot-east", capacity=2, effective_capacity=2, used=2),
               PoolFigures("ondemand-east", capacity=4, effective_capacity=1, used=1, backoff_s=40, refusals=3)]
    report = diagnose(figures(d))
    verdict = report.verdict
    assert (verdict.layer, verdict.area) == ("infrastructure", "capacity")
    assert [f.area for f in report.findings][:2] == ["capacity", "admission"]  # the queue is the symptom
    text = render(report)
    assert ("verdict: infrastructure: capacity: 2 of the 5 replicas the scaler wants cannot be placed: every pool "
            "the deployment may use is full or refusing [chat]") in text
    assert "pool spot-east: 2 of 2 replicas used" in text
    assert "pool ondemand-east: 1 of 1 replicas used (capacity 4; backed off 40 s after refusing), 3 refusals" in text
    assert "strata pools set POOL --capacity N" in verdict.fix
    assert "pools spot-east 2/2, ondemand-east 1/1 (short 2)" in text
    d.short = 0  # placed: no capacity finding, the admission wait is about replicas again
    assert diagnose(figures(d)).verdict.area == "admission"


def test_pool_figures_come_from_the_scalers_metrics():
    text = "\n".join([
        'strata:pool_capacity_replicas{pool="a"} 4.0', 'strata:pool_effective_capacity_replicas{pool="a"} 2.0',
        'strata:pool_used_replicas{pool="a"} 2.0', 'strata:pool_ready_replicas{pool="a"} 2.0',
        'strata:pool_backoff_seconds{pool="a"} 12.0', "# TYPE strata:pool_refusals counter",
        'strata:pool_refusals_total{pool="a"} 3.0', 'strata:pool_cost_per_hour{pool="a"} 20.0', ""])
    pools = _pools([Samples(text, 0.0)])
    assert pools["a"] == PoolFigures("a", 4, 2, 2, 2, 12, 3, 20)
