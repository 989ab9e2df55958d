"""The Kubernetes actuator against fake API servers (no cluster runs here: tests/scaler/
fake_kubernetes.py): it reads the Deployment and patches its scale subresource the way the real
API expects; the scaler drives it from live signals on the bus; with two clusters as capacity
pools, one that starts refusing sends the replicas to the other within the tick, and when it has
room again they move back make-before-break."""

import asyncio
import time
import uuid

import aiohttp
import pytest

from services.control.pools import PoolStore
from services.control.spec import validate
from services.control.store import DeploymentStore
from services.scaler.actuators import KubernetesActuator, LocalProcessActuator, PoolRefused, pool_actuator
from services.scaler.placement import Placer
from services.scaler.pools import PoolSet
from services.scaler.service import ScalerConfig, ScalerService
from shared import protocol
from shared.bus import Bus
from shared.deployments import Placement
from shared.pools import parse_pool
from shared.protocol import PoolStatus, SchedulerStats
from shared.store import connect_redis
from tests.scaler.fake_kubernetes import TOKEN, FakeKubernetesApiServer


async def test_scale_reads_the_deployment_then_patches_only_on_change(tiny_model_dir):
    spec = validate({"name": "llm", "model": str(tiny_model_dir)})
    async with FakeKubernetesApiServer("strata", {"strata-engine-llm": 1}) as api:
        actuator = KubernetesActuator(api.url, "strata", token=TOKEN)
        try:
            await actuator.observe(["llm"])
            assert actuator.alive() == 1
            await actuator.scale("llm", 1, spec, 3, {})
            assert api.replicas["strata-engine-llm"] == 3
            assert [(c.method, c.body) for c in api.calls] == [("GET", None), ("PATCH", {"spec": {"replicas": 3}})]
            assert api.calls[0].status == 200 and api.calls[1].status == 200
            await actuator.observe(["llm"])  # the fake runs every pod at once
            assert actuator.held("llm", 1).ready == 3 and actuator.starting("llm", 1, ready=1) == 2
            api.calls.clear()
            await actuator.scale("llm", 1, spec, 3, {})  # already there: nothing to send
            assert api.calls == []
            # Revisions add up on the one Deployment (the cluster rolls its pods itself).
            await actuator.scale("llm", 2, spec, 1, {})
            assert api.replicas["strata-engine-llm"] == 4
            await actuator.scale("llm", 1, spec, 0, {})
            assert api.replicas["strata-engine-llm"] == 1 and actuator.revisions("llm") == {2}
            with pytest.raises(PoolRefused, match="404.*not found"):
                await actuator.scale("missing", 1, spec, 1, {})
        finally:
            await actuator.close()


async def test_pods_pending_past_the_timeout_and_api_refusals_are_the_pool_refusing(tiny_model_dir, tmp_path):
    spec = validate({"name": "llm", "model": str(tiny_model_dir)})
    async with FakeKubernetesApiServer("strata", {"strata-engine-llm": 0}, gpus=2) as api:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        actuator = pool_actuator(parse_pool({"name": "a", "capacity": 8, "actuator": {
            "kind": "kubernetes", "api_url": api.url, "namespace": "strata", "token_file": str(token_file),
            "pending_timeout_s": 0.3}}), "", "", tmp_path)
        try:
            await actuator.scale("llm", 1, spec, 4, {})  # two run, two stay Pending
            await actuator.observe(["llm"])
            assert actuator.held("llm", 1).ready == 2 and actuator.held("llm", 1).starting == 2
            await actuator.scale("llm", 1, spec, 4, {})  # pending, but not for long yet
            await asyncio.sleep(0.4)
            await actuator.observe(["llm"])
            with pytest.raises(PoolRefused, match="2 pods of strata-engine-llm not ready after 0.3s") as refused:
                await actuator.scale("llm", 1, spec, 4, {})
            assert refused.value.held == 2
            assert actuator.take_cold_starts() and all(c < 0.5 for c in actuator.take_cold_starts() or [0])
            await actuator.scale("llm", 1, spec, 2, {})  # placement takes it back to what runs: no refusal
            api.refuse_scale_up = 'pods "x" is forbidden: exceeded quota: gpu-quota'
            with pytest.raises(PoolRefused, match="403.*exceeded quota"):
                await actuator.scale("llm", 1, spec, 3, {})
            assert api.replicas["strata-engine-llm"] == 2
        finally:
            await actuator.close()
    unreachable = KubernetesActuator(api.url, "strata", token=TOKEN, timeout=1.0)  # the server is gone
    try:
        with pytest.raises(PoolRefused, match="Kubernetes API GET|Kubernetes API PATCH"):
            await unreachable.scale("llm", 1, spec, 1, {})
    finally:
        await unreachable.close()
    no_ca = KubernetesActuator(api.url, "strata", token=TOKEN, ca_file=str(tmp_path / "missing-ca.crt"))
    try:  # a CA bundle given and not there is the pool refusing, by name (not an unverified connection)
        with pytest.raises(PoolRefused, match="cannot read the CA file .*missing-ca.crt"):
            await no_ca.scale("llm", 1, spec, 1, {})
    finally:
        await no_ca.close()


async def test_placement_over_two_clusters_spills_on_refusal_and_moves_back(tiny_model_dir, tmp_path):
    """PoolSet (the scaler's pools) over two fake clusters, ticked by hand."""
    spec = validate({"name": "llm", "model": str(tiny_model_dir)})
    async with FakeKubernetesApiServer("strata", {"strata-engine-llm": 0}) as a, \
            FakeKubernetesApiServer("strata", {"strata-engine-llm": 0}) as b:
        pools = PoolSet(LocalProcessActuator("", "", tmp_path),
                        lambda s: pool_actuator(s, "", "", tmp_path), placer=Placer(backoff_s=0.5))
        await pools.sync({n: parse_pool({"name": n, "capacity": 10, "cost_per_hour": cost, "actuator": {
            "kind": "kubernetes", "api_url": api.url, "namespace": "strata", "token": TOKEN}})
            for n, cost, api in (("cheap", 1.0, a), ("dear", 3.0, b))})
        assert set(pools.pools) == {"default", "cheap", "dear"} and pools.pools["default"].retiring

        async def tick(wanted):
            await pools.observe(["llm"], time.monotonic())
            return await pools.place("llm", 1, spec, wanted, Placement(), {}, time.monotonic())

        try:
            assert (await tick(3)).targets == {"cheap": 3, "dear": 0}
            a.refuse_scale_up = "exceeded quota"
            plan = await tick(5)  # cheap says no: the two go to dear in this same call
            assert plan.targets == {"cheap": 3, "dear": 2} and a.replicas["strata-engine-llm"] == 3
            assert b.replicas["strata-engine-llm"] == 2 and b.patches("strata-engine-llm")[-1].at >= \
                a.patches("strata-engine-llm", accepted=False)[-1].at
            assert pools.placer.refusals("cheap") == 1
            a.refuse_scale_up = None
            await asyncio.sleep(0.6)  # the back-off ends: cheap is probed with all it can take
            plan = await tick(5)
            assert plan.targets == {"cheap": 5, "dear": 2} and plan.kept == {"dear": 2}
            assert a.replicas["strata-engine-llm"] == 5 and b.replicas["strata-engine-llm"] == 2
            plan = await tick(5)  # cheap's are ready now: dear's drain
            assert plan.targets == {"cheap": 5, "dear": 0} and b.replicas["strata-engine-llm"] == 0
            reports = {r.name: r for r in pools.reports(["llm"], time.monotonic())}
            assert reports["cheap"].ready == 5 and reports["cheap"].refusals == 1
            assert reports["cheap"].last_refusal.endswith("exceeded quota")
        finally:
            await pools.close()


async def test_scaler_scales_a_deployment_from_zero_through_the_api(infra, tiny_model_dir):
    name = f"k8s-{uuid.uuid4().hex[:6]}"
    redis = connect_redis(infra.redis_url)
    bus = await Bus.connect(infra.nats_url, "test-k8s")
    async with FakeKubernetesApiServer("strata", {f"strata-engine-{name}": 0}) as api:
        scaler = ScalerService(ScalerConfig(infra.nats_url, infra.redis_url, "k8s-test", interval=0.2),
                               KubernetesActuator(api.url, "strata", token=TOKEN))
        await scaler.start()
        try:
            await DeploymentStore(redis).apply(validate({
                "name": name, "model": str(tiny_model_dir), "replicas": {"min": 0, "max": 3}}))
            await bus.publish(protocol.CONTROL_DEPLOYMENTS, protocol.DeploymentChanged(name=name, action="apply",
                                                                                     generation=1, stable=1))
            await asyncio.sleep(1.0)
            assert api.replicas[f"strata-engine-{name}"] == 0  # min 0, no demand: nothing to run
            deadline = time.monotonic() + 15
            while api.replicas[f"strata-engine-{name}"] == 0 and time.monotonic() < deadline:
                # A request waits in a scheduler's queue: the scaler's signal to start a replica.
                await bus.publish(protocol.scheduler_stats("sched-x"), SchedulerStats(
                    scheduler_id="sched-x", queue_depth={name: 3}, oldest_wait_s={name: 0.5},
                    timestamp=time.time()))
                await asyncio.sleep(0.2)
            assert 1 <= api.replicas[f"strata-engine-{name}"] <= 3
            assert any(c.method == "PATCH" for c in api.calls)
        finally:
            await scaler.stop()
            await DeploymentStore(redis).delete(name)  # the session's Valkey is shared with other stacks
            await bus.close()
            await redis.aclose()


async def test_scaler_over_two_fake_clusters_spills_within_one_tick(infra, tiny_model_dir, tmp_path):
    """The scaler service with two pools in control's store, each a fake cluster: the cheaper
    one refuses a scale-up, and the replicas appear in the other within the same tick."""
    name = f"pools-{uuid.uuid4().hex[:6]}"
    deployment = f"strata-engine-{name}"
    redis = connect_redis(infra.redis_url)
    bus = await Bus.connect(infra.nats_url, "test-pools")
    statuses: list[PoolStatus] = []

    async def on_status(msg: PoolStatus, _raw) -> None:
        statuses.append(msg)

    await bus.subscribe(protocol.SCALER_POOLS, PoolStatus, on_status)
    interval = 0.25
    async with FakeKubernetesApiServer("strata", {deployment: 0}) as east, \
            FakeKubernetesApiServer("strata", {deployment: 0}) as west:
        pool_names = [f"{name}-east", f"{name}-west"]
        store = PoolStore(redis)
        for pool, cost, api in ((pool_names[0], 1.0, east), (pool_names[1], 2.5, west)):
            await store.apply(parse_pool({"name": pool, "region": pool.rsplit("-", 1)[1], "capacity": 6,
                                          "cost_per_hour": cost, "actuator": {
                                              "kind": "kubernetes", "api_url": api.url, "namespace": "strata",
                                              "token": TOKEN}}))
        scaler = ScalerService(ScalerConfig(infra.nats_url, infra.redis_url, f"pools-{name}", interval=interval,
                                            pool_backoff_s=60.0),
                               LocalProcessActuator(infra.nats_url, infra.redis_url, tmp_path),
                               lambda s: pool_actuator(s, infra.nats_url, infra.redis_url, tmp_path))
        await scaler.start()

        async def demand(queued: int, until, what: str, timeout: float = 15.0) -> None:
            deadline = time.monotonic() + timeout
            while not until():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await bus.publish(protocol.scheduler_stats("sched-pools"), SchedulerStats(
                    scheduler_id="sched-pools", queue_depth={name: queued}, oldest_wait_s={name: 1.0},
                    timestamp=time.time()))
                await asyncio.sleep(0.1)

        try:
            await DeploymentStore(redis).apply(validate({
                "name": name, "model": str(tiny_model_dir), "replicas": {"min": 0, "max": 6},
                "scaling": {"target_concurrency": 1}, "placement": {"pools": pool_names}}))
            await bus.publish(protocol.CONTROL_DEPLOYMENTS, protocol.DeploymentChanged(
                name=name, action="apply", generation=1, stable=1))
            await demand(2, lambda: east.replicas[deployment] == 2, "two replicas in the cheaper pool")
            assert west.replicas[deployment] == 0

            east.refuse_scale_up = "exceeded quota: gpu-quota, requested: nvidia.com/gpu=8, limited: 16"
            await demand(5, lambda: west.replicas[deployment] > 0, "replicas in the other pool")
            refused = east.patches(deployment, accepted=False)[0]
            spilled = west.patches(deployment)[0]
            assert spilled.at - refused.at < interval, "the other pool took them in a later tick"
            assert east.replicas[deployment] == 2  # the refusing pool keeps what it runs
            await demand(5, lambda: west.replicas[deployment] == 3, "the rest in the other pool")

            wanted = [f'strata:pool_refusals_total{{pool="{pool_names[0]}"}} 1.0',
                      f'strata:pool_ready_replicas{{pool="{pool_names[1]}"}} 3.0',
                      f'strata:pool_cost_per_hour{{pool="{pool_names[1]}"}} 7.5']
            async with aiohttp.ClientSession() as http:
                deadline = time.monotonic() + 5  # readiness shows at the next tick's read of the clusters
                while True:
                    async with http.get(f"{scaler.http_url}/metrics") as resp:
                        metrics = await resp.text()
                    if all(line in metrics for line in wanted) or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
            assert [line for line in wanted if line not in metrics] == []
            report = {p.name: p for p in statuses[-1].pools}
            assert report[pool_names[0]].refusals == 1 and report[pool_names[0]].backoff_s > 0
            assert report[pool_names[1]].deployments == {name: 3}
        finally:
            await scaler.stop()
            await DeploymentStore(redis).delete(name)
            for pool in pool_names:
                await store.delete(pool)
            await bus.close()
            await redis.aclose()
