"""The canary analysis' driver on a real Valkey, fed gateway reports as the bus brings them, on a
clock the test moves: it walks a healthy canary through its steps and promotes it, rolls a slow
one back, records why, stops when a person takes over, and resumes after a restart."""

import uuid

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.control.canary_driver import CanaryDriver, read_run
from services.control.spec import validate
from services.control.store import DeploymentError, DeploymentStore
from shared import deployments
from shared.protocol import GatewayStats, LatencySample, RevisionOutcomes
from shared.store import connect_redis

ANALYSIS = {"steps": [20, 50, 100], "interval_s": 5, "min_requests": 30}


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def setup(infra):
    redis = connect_redis(infra.redis_url)
    store, clock, announced = DeploymentStore(redis), Clock(), []

    async def announce(name, action, state):
        announced.append((name, action, state.canary_weight))

    registry = CollectorRegistry()
    driver = CanaryDriver(redis, store, announce, registry, clock=clock)
    name = f"auto-{uuid.uuid4().hex[:6]}"
    yield driver, store, clock, announced, registry, name
    if await deployments.read_state(redis, name) is not None:
        await store.delete(name)
    await redis.aclose()


def spec(model_dir, name, **canary):
    return validate({"name": name, "model": str(model_dir), "replicas": {"min": 1, "max": 1}, "canary": canary})


def report(name: str, clock: Clock, rng, revision: int, n: int, slow: float = 1.0, errors: int = 0) -> GatewayStats:
    """A gateway's report of n requests of one revision that finished over the last two seconds."""
    samples = [LatencySample(revision=revision, finished_at=clock.now - 2.0 * i / n,
                             ttft_s=float(rng.lognormal(np.log(0.05), 0.4)) * slow,
                             itl_s=float(rng.lognormal(np.log(0.01), 0.3)) * slow, output_tokens=8)
               for i in range(n - errors)]
    return GatewayStats(gateway_id="gw", timestamp=clock.now, samples={name: samples},
                        outcomes={name: {revision: RevisionOutcomes(requests=n, errors=errors)}})


async def serve(driver, clock, name, rng, canary: int, stable: int, seconds: int, weight: int, slow=1.0, rate=50):
    """`seconds` of traffic at `rate` requests/s split by `weight`, one report every 2 s, ticking."""
    for _ in range(seconds // 2):
        clock.now += 2.0
        driver.on_gateway_stats(report(name, clock, rng, canary, max(2 * rate * weight // 100, 1), slow))
        driver.on_gateway_stats(report(name, clock, rng, stable, 2 * rate * (100 - weight) // 100))
        await driver.tick()


async def test_a_healthy_canary_walks_its_steps_and_is_promoted(setup, tiny_model_dir):
    driver, store, clock, announced, registry, name = setup
    rng = np.random.default_rng(0)
    await store.apply(spec(tiny_model_dir, name))
    applied = await store.apply(spec(tiny_model_dir, name, analysis=ANALYSIS))
    assert (applied.canary, applied.canary_weight) == (2, 20)  # the weight is the first step's
    await driver.refresh(name)
    run = await read_run(store.redis, name)
    assert (run.status, run.step, run.steps) == ("running", 20, [20, 50])
    assert registry.get_sample_value("strata:control_canary_decisions_total",
                                     {"deployment": name, "decision": "rollback"}) == 0.0  # from 0: alerts see it

    await serve(driver, clock, name, rng, 2, 1, seconds=6, weight=20, rate=10)  # 12 canary requests: too few
    run = await read_run(store.redis, name)
    assert run.last["decision"] == "wait" and "waiting for 30 requests" in run.last["reason"]
    await serve(driver, clock, name, rng, 2, 1, seconds=10, weight=20)
    state = await deployments.read_state(store.redis, name)
    assert (state.canary, state.canary_weight) == (2, 50), (await read_run(store.redis, name)).last
    await serve(driver, clock, name, rng, 2, 1, seconds=12, weight=50)
    state = await deployments.read_state(store.redis, name)
    assert (state.stable, state.canary) == (2, 0)
    assert [a for _, a, _ in announced] == ["canary", "promote"]
    events = (await deployments.history(store.redis, name))[-2:]
    assert [(e["action"], e["actor"]) for e in events] == [("canary", "canary-analysis"), ("promote", "canary-analysis")]
    assert events[0]["analysis"]["decision"] == "pass" and events[0]["analysis"]["step"] == 20
    assert {c["name"] for c in events[0]["analysis"]["checks"]} == {"ttft_p90", "itl_p50", "error_rate"}
    run = await read_run(store.redis, name)
    assert run.status == "promoted" and [v["step"] for v in run.verdicts] == [20, 50]
    assert registry.get_sample_value("strata:control_canary_decisions_total",
                                     {"deployment": name, "decision": "promote"}) == 1.0


async def test_a_slow_canary_is_rolled_back_at_its_first_step_with_the_reason(setup, tiny_model_dir):
    driver, store, clock, announced, registry, name = setup
    rng = np.random.default_rng(1)
    await store.apply(spec(tiny_model_dir, name))
    await store.apply(spec(tiny_model_dir, name, analysis=ANALYSIS))
    await driver.refresh(name)
    await serve(driver, clock, name, rng, 2, 1, seconds=14, weight=20, slow=3.0)
    state = await deployments.read_state(store.redis, name)
    assert (state.stable, state.canary) == (1, 0)
    event = (await deployments.history(store.redis, name))[-1]
    assert (event["action"], event["actor"]) == ("rollback", "canary-analysis")
    assert event["analysis"]["decision"] == "fail" and event["analysis"]["step"] == 20
    assert event["analysis"]["canary_revision"] == 2 and "TTFT p90" in event["analysis"]["reason"]
    run = await read_run(store.redis, name)
    assert run.status == "rolled_back" and run.reason == event["analysis"]["reason"]
    assert registry.get_sample_value("strata:control_canary_decisions_total",
                                     {"deployment": name, "decision": "rollback"}) == 1.0


async def test_a_weight_set_by_hand_stops_the_analysis_and_a_restart_resumes_it(setup, tiny_model_dir):
    driver, store, clock, announced, registry, name = setup
    rng = np.random.default_rng(2)
    await store.apply(spec(tiny_model_dir, name))
    await store.apply(spec(tiny_model_dir, name, analysis=ANALYSIS))
    await driver.refresh(name)
    await serve(driver, clock, name, rng, 2, 1, seconds=4, weight=20)

    # A restarted control (a new driver, no samples) resumes the stored run at its step.
    again = CanaryDriver(store.redis, store, driver.announce, CollectorRegistry(), clock=clock)
    await again.refresh(name)
    run = await read_run(store.redis, name)
    assert run.status == "running" and run.step == 20 and run.step_started_at == clock.now

    # The analysis only acts on what it judged: a changed weight is a 409, nothing changes.
    with pytest.raises(DeploymentError) as info:
        await store.analysis_step(name, 2, 50, "promote", 100, {})
    assert info.value.status == 409

    await store.set_canary(name, 30, actor="ops")
    await serve(again, clock, name, rng, 2, 1, seconds=14, weight=30)
    run = await read_run(store.redis, name)
    assert run.status == "manual" and "set to 30% by hand" in run.reason
    state = await deployments.read_state(store.redis, name)
    assert (state.canary, state.canary_weight) == (2, 30)  # untouched since
    await store.promote(name, actor="ops")
    await again.tick()
    assert (await read_run(store.redis, name)).status == "manual"  # a finished run stays as it ended


async def test_a_revision_without_an_analysis_is_left_alone(setup, tiny_model_dir):
    driver, store, clock, announced, registry, name = setup
    await store.apply(spec(tiny_model_dir, name))
    await store.apply(spec(tiny_model_dir, name, weight=10))
    await serve(driver, clock, name, np.random.default_rng(3), 2, 1, seconds=20, weight=10, slow=5.0)
    assert await read_run(store.redis, name) is None and announced == []
    assert registry.get_sample_value("strata:control_canary_weight_percent", {"deployment": name}) == 10.0
