"""Capacity pools in control: the spec's checks, the store in a real Valkey, the REST API of a
real control service (tokens never shown, changes announced on the bus, the scaler's report
merged in), and `strata pools` against it."""

import asyncio
import time
import uuid

import aiohttp
import pytest

from services.control import cli
from services.control.pools import PoolStore
from services.control.pools_cli import render_pools
from services.control.service import ControlConfig, ControlService
from services.control.store import DeploymentError
from services.gateway.auth import create_key
from shared import protocol
from shared.bus import Bus
from shared.pools import PoolSpecError, parse_pool, parse_pools, read_pools
from shared.protocol import PoolChanged, PoolReport, PoolStatus
from shared.store import connect_redis


def errors(data) -> list[str]:
    with pytest.raises(PoolSpecError) as exc:
        parse_pools(data) if isinstance(data, list) else parse_pool(data)
    return [f for f, _ in exc.value.errors]


def test_a_pool_spec_is_checked_field_by_field():
    pool = parse_pool({"name": "spot-east", "region": "us-east", "capacity": 40, "cost_per_hour": 2.5,
                       "cold_start_s": 45, "labels": {"accelerator": "h100"},
                       "actuator": {"kind": "kubernetes", "api_url": "https://k8s.example:6443", "namespace": "gpu",
                                    "token_file": "/etc/strata/token", "pending_timeout_s": 120}})
    assert (pool.capacity, pool.actuator.namespace, pool.actuator.pending_timeout_s) == (40, "gpu", 120.0)
    assert parse_pool({"name": "here", "capacity": 2}).actuator.kind == "local"
    assert errors({"name": "default", "capacity": 1}) == ["name"]  # the scaler's own
    assert errors({"name": "x"}) == ["capacity"]
    assert errors({"name": "x", "capacity": -1, "cost_per_hour": "cheap", "colour": "red"}) == [
        "colour", "capacity", "cost_per_hour"]
    assert errors({"name": "x", "capacity": 1, "actuator": {"kind": "ec2"}}) == ["actuator.kind"]
    assert errors({"name": "x", "capacity": 1, "actuator": {"kind": "kubernetes"}}) == ["actuator.api_url"]
    assert errors({"name": "x", "capacity": 1, "actuator": {"kind": "kubernetes", "api_url": "https://k",
                                                            "token": "t", "token_file": "/f"}}) == ["actuator.token"]
    assert errors({"name": "x", "capacity": 1, "actuator": {"kind": "local", "api_url": "https://k"}}) == [
        "actuator.api_url"]
    assert errors([{"name": "a", "capacity": 1}, {"name": "a", "capacity": 2}]) == ["pools.a"]
    assert errors([{"name": "a", "capacity": 1}, {"name": "b"}]) == ["pools.b.capacity"]


@pytest.fixture
async def redis(infra):
    """The session's Valkey: the pools a test makes are deleted after it (scalers in other tests
    share it and would act on them)."""
    r = connect_redis(infra.redis_url)
    before = set(await read_pools(r))
    yield r
    for name in set(await read_pools(r)) - before:
        await PoolStore(r).delete(name)
    await r.aclose()


async def test_the_store_counts_generations_and_checks_every_change(redis):
    store, name = PoolStore(redis), f"pool-{uuid.uuid4().hex[:6]}"
    first = await store.apply(parse_pool({"name": name, "capacity": 2, "cost_per_hour": 1.0}))
    assert first.generation == 1 and (await read_pools(redis))[name] == first
    changed = await store.set(name, {"capacity": 5, "labels": {"accelerator": "cpu"}})
    assert (changed.generation, changed.capacity, changed.labels, changed.cost_per_hour) == (
        2, 5, {"accelerator": "cpu"}, 1.0)
    with pytest.raises(PoolSpecError, match="capacity"):
        await store.set(name, {"capacity": -3})
    with pytest.raises(PoolSpecError, match="actuator: cannot be set on a running pool"):
        await store.set(name, {"actuator": {"kind": "kubernetes"}})
    assert (await store.get(name)).capacity == 5  # nothing half-applied
    await store.delete(name)
    with pytest.raises(DeploymentError, match="does not exist"):
        await store.set(name, {"capacity": 1})
    with pytest.raises(DeploymentError):
        await store.delete(name)


@pytest.fixture
async def control(infra, redis):
    service = ControlService(ControlConfig(infra.nats_url, infra.redis_url, port=0, control_id="pools-test"))
    await service.start()
    yield service
    await service.stop()


async def test_the_api_hides_tokens_announces_changes_and_merges_the_scalers_report(control, redis, infra,
                                                                                    tiny_model_dir):
    key = await create_key(redis, "pools-admin", admin=True)
    tenant = await create_key(redis, "pools-tenant")
    suffix = uuid.uuid4().hex[:6]
    spot, cluster = f"spot-{suffix}", f"k8s-{suffix}"
    bus = await Bus.connect(infra.nats_url, "test-pools-api")
    announced: list[PoolChanged] = []

    async def on_change(msg: PoolChanged, _raw) -> None:
        announced.append(msg)

    await bus.subscribe(protocol.CONTROL_POOLS, PoolChanged, on_change)
    text = f"""
pools:
  - {{name: {spot}, region: us-east, capacity: 2, cost_per_hour: 1.5}}
  - name: {cluster}
    region: us-west
    capacity: 8
    cost_per_hour: 4
    actuator: {{kind: kubernetes, api_url: "https://k8s.example:6443", token: very-secret}}
"""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(control.url, headers=headers) as http:
        async with http.post("/api/v1/pools", data=text) as resp:
            assert resp.status == 201
            body = await resp.json()
        assert [p["name"] for p in body["pools"]] == [spot, cluster]
        assert body["pools"][1]["actuator"]["token"] == "(set)" and "very-secret" not in str(body)
        async with http.get("/api/v1/pools") as resp:
            listed = await resp.json()
        mine = {p["name"]: p for p in listed["pools"] if p["name"] in (spot, cluster)}
        assert mine[cluster]["spec"]["actuator"]["token"] == "(set)" and mine[spot]["status"] is None
        assert (await read_pools(redis))[cluster].actuator.token == "very-secret"  # the scaler reads it

        await bus.publish(protocol.SCALER_POOLS, PoolStatus(
            scaler_id="scaler-x", timestamp=time.time(), short={"chat": 1}, wanted={"chat": 3},
            pools=[PoolReport(name=spot, region="us-east", kind="local", capacity=2, effective_capacity=2, used=2,
                              ready=2, cost_per_hour=1.5, cold_start_s=12.0, cold_start_measured=True,
                              deployments={"chat": 2})]))
        deadline = time.monotonic() + 5
        while True:
            async with http.get(f"/api/v1/pools/{spot}") as resp:
                one = await resp.json()
            if one["status"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert one["status"]["used"] == 2 and one["status"]["deployments"] == {"chat": 2}

        async with http.patch(f"/api/v1/pools/{spot}", json={"capacity": 3}) as resp:
            assert resp.status == 200 and (await resp.json())["pool"]["generation"] == 2
        async with http.patch(f"/api/v1/pools/{spot}", json={"capacity": "lots"}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["param"] == "capacity" and error["message"].startswith("invalid pool spec: capacity:")
        async with http.post("/api/v1/deployments", data=f"name: placed-{suffix}\nmodel: {tiny_model_dir}\n"
                                                         f"placement: {{pools: [{spot}, nowhere]}}\n") as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["param"] == "placement.pools" and "no such pool: nowhere" in error["message"]
        async with http.get("/api/v1/pools", headers={"Authorization": f"Bearer {tenant}"}) as resp:
            assert resp.status == 403

        out = await asyncio.to_thread(cli_output, ["pools", "--control-url", control.url, "--api-key", key])
        assert spot in out and "chat 2" in out and "$3.00" in out and "12 s" in out
        assert "short: chat wants 3 replicas, 1 cannot be placed" in out
        assert "no report from the scaler" in out  # the cluster pool: stored, not reported

        async with http.delete(f"/api/v1/pools/{cluster}") as resp:
            assert resp.status == 200
        async with http.get(f"/api/v1/pools/{cluster}") as resp:
            assert resp.status == 404
    await asyncio.sleep(0.2)
    await bus.close()
    assert [(m.name, m.action) for m in announced] == [(spot, "apply"), (cluster, "apply"), (spot, "set"),
                                                       (cluster, "delete")]


def cli_output(argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    return buf.getvalue()


def test_strata_pools_shows_backoff_full_and_unlimited():
    report = {"name": "a", "region": "r", "kind": "kubernetes", "capacity": 4, "effective_capacity": 1, "used": 1,
              "ready": 1, "starting": 0, "draining": 0, "cost_per_hour": 2.0, "cold_start_s": 30.0,
              "cold_start_measured": False, "refusals": 2, "backoff_s": 40.0, "last_refusal": "403 exceeded quota",
              "deployments": {"chat": 1}}
    default = {**report, "name": "default", "kind": "", "capacity": 2**31 - 1, "effective_capacity": 2**31 - 1,
               "backoff_s": 0.0, "refusals": 0}
    text = render_pools({"pools": [{"name": "a", "spec": None, "status": report},
                                   {"name": "default", "spec": None, "status": default}],
                         "short": {}, "wanted": {}, "scaler": "s"})
    assert "1/4" in text and "backed off 40 s: 403 exceeded quota" in text and "30 s (spec)" in text
    assert "no limit" in text and "scaler's own" in text
    assert render_pools({"pools": [], "short": {}, "wanted": {}, "scaler": None}).startswith("no capacity pools")


def test_strata_up_pools_takes_a_file_or_gives_the_demo(tmp_path):
    assert [p["capacity"] for p in cli.up_pools("demo")] == [1, 2] and cli.up_pools(None) is None
    good = tmp_path / "pools.yaml"
    good.write_text("pools:\n  - {name: here, capacity: 3, cost_per_hour: 1}\n")
    (pool,) = cli.up_pools(str(good))
    assert parse_pool(pool).capacity == 3  # what control is sent reads back as the same pool
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {name: here}\n")
    with pytest.raises(ValueError, match="pools.here.capacity: required"):
        cli.up_pools(str(bad))
    assert cli.main(["up", "--pools", str(bad)]) == 2  # before anything starts
