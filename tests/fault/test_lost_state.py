"""The store loses everything (Valkey SIGKILLed and started again without its data): an outage
to alarm on, never an instruction. The fleet keeps serving with the keys it knew, the scaler
drains nothing (it holds the desired state it last saw), control writes the deployment back
and announces it, and a deleted deployment still goes away (its tombstone says so)."""

import asyncio
import shutil
import signal
import time

import aiohttp
import pytest

from services.gateway.auth import hash_key
from shared import keys
from tests.fault.conftest import Load, make_stack, metric, stream_completion

MODEL = "tiny-llama"
ALIAS = "tiny-held"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("lost-state-logs"), engines=0, control=True, scaler=True,
                   scaler_args=["--engine-arg=--threads=1", "--engine-arg=--num-kv-blocks=512"])
    s.deploy({"name": MODEL, "model": str(tiny_model_dir), "aliases": [ALIAS], "replicas": {"min": 1, "max": 1},
              "limits": {"default_max_tokens": 5}})
    s.wait_replicas(MODEL, 1, timeout=120)
    s.wait_serving(60)
    yield s
    s.stop()


async def replicas(redis) -> set[str]:
    return {m.decode() for m in await redis.smembers(keys.model_replicas(MODEL))
            if await redis.exists(keys.replica(m.decode()))}


async def test_a_deployments_limits_bound_requests_without_max_tokens(stack):
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                             json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}],
                                   "temperature": 0, "ignore_eos": True}) as resp:
            body = await resp.json()
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 5, body


async def wipe_valkey(stack, redis) -> float:
    """SIGKILL Valkey and start it again on its port without its data; returns when it is back."""
    valkey = next(p for p in stack.infra.processes if p.name == "valkey")
    valkey.proc.send_signal(signal.SIGKILL)
    valkey.proc.wait(10)
    stack.infra.processes.remove(valkey)
    shutil.rmtree(stack.infra.valkey_dir(valkey.port))
    await asyncio.to_thread(stack.infra.start_valkey, 20.0, valkey.port)
    await redis.connection_pool.disconnect()  # the test's own connections: not what is under test
    return time.monotonic()


@pytest.mark.slow
async def test_valkey_restarted_empty_the_fleet_serves_on_and_the_scaler_drains_nothing(stack, redis):
    tenant = stack.client.create_key("lost-state-tenant")["api_key"]
    before = await replicas(redis)
    assert len(before) == 1
    generation = int((await redis.hget(keys.deployment(MODEL), "generation")).decode())
    scaler_log = stack.log_dir / "scaler.log"
    log_offset = scaler_log.stat().st_size
    async with aiohttp.ClientSession() as http:  # the gateway knows the tenant's key now
        assert (await stream_completion(http, stack.base_url, tenant, {"model": ALIAS, "prompt": "x"})).ok
    control = stack.services["control"]

    async with Load([stack.base_url], tenant, concurrency=4, timeout=20) as load:
        await asyncio.sleep(2)
        # 1. With control frozen, nobody can write the deployment back: every reader holds it.
        control.send_signal(signal.SIGSTOP)
        try:
            first = await wipe_valkey(stack, redis)
            await asyncio.sleep(8)  # past every watcher's resync (5 s) and many scaler ticks
            assert not await redis.exists(keys.deployment(MODEL))  # really gone from the store
            assert await replicas(redis) == before  # the engine re-registered itself, and still serves
            scaler_url = (await redis.hget(keys.service("scaler", "scaler-0"), "http_url")).decode()
            deadline = time.monotonic() + 20  # the alarm: at the scaler's next resync after it reconnects
            while await metric(scaler_url, "strata:scaler_deployments_missing_from_store") != 1:
                assert time.monotonic() < deadline, "the scaler never reported the deployment missing"
                await asyncio.sleep(0.5)
        finally:
            control.send_signal(signal.SIGCONT)
        # 2. Control back: it writes its copy back and announces it.
        deadline = time.monotonic() + 10
        while not await redis.exists(keys.deployment(MODEL)):
            assert time.monotonic() < deadline, "control did not restore the deployment"
            await asyncio.sleep(0.2)
        # 3. Once more with control running: restored at once.
        second = await wipe_valkey(stack, redis)
        await asyncio.sleep(6)
    print(f"\nvalkey restarted empty twice: {load.summary()}")
    assert all(r.outcome.status != -1 for r in load.records), "a request hung"
    late = [r for r in load.records if r.started > first + 2]
    assert len(late) >= 8 and all(r.outcome.ok for r in late), [r.outcome for r in late if not r.outcome.ok][:3]

    # The scaler held the deployment and drained nothing; it said why it held it.
    assert await replicas(redis) == before
    scaler_lines = scaler_log.read_text(errors="replace")[log_offset:]
    assert "engine draining" not in scaler_lines and '"desired": 0' not in scaler_lines
    assert "missing from the store without being deleted" in scaler_lines
    # Control wrote it back both times (same generation: nothing changed) and announced it.
    state = await redis.hgetall(keys.deployment(MODEL))
    assert state and int(state[b"generation"]) == generation and await redis.sismember(keys.DEPLOYMENTS, MODEL)
    assert await metric(stack.control_url, "strata:control_deployments_restored_total") >= 2
    assert '"action": "restore"' in (stack.log_dir / "control.log").read_text(errors="replace")
    # The keys the services knew were written back: the tenant's by the gateway, the admin key by control.
    assert await redis.exists(keys.api_key(hash_key(tenant)))
    assert stack.client.status(MODEL)["deployment"]["generation"] == generation
    assert second > first


@pytest.mark.slow
async def test_a_deleted_deployment_still_goes_away(stack, redis):
    """Holding on through a lost store must not make a real delete impossible."""
    spec = {"name": "tiny-doomed", "model": stack.model_dir, "replicas": {"min": 0, "max": 1}}
    stack.deploy(spec)
    await asyncio.sleep(1.5)
    stack.client.delete("tiny-doomed")
    assert await redis.exists(keys.deployment_deleted("tiny-doomed"))
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 15
        while True:  # the gateway forgets it (its watcher sees the tombstone)
            async with http.get(stack.base_url + "/v1/models", headers={"Authorization": f"Bearer {stack.api_key}"}) \
                    as resp:
                names = {m["id"] for m in (await resp.json())["data"]}
            if "tiny-doomed" not in names:
                break
            assert time.monotonic() < deadline, names
            await asyncio.sleep(0.3)
    assert not await redis.exists(keys.deployment("tiny-doomed"))  # and control did not restore it
