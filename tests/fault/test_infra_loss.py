"""The infrastructure under load: Valkey and the NATS server restarted, a scheduler and a gateway
replica killed. Every accepted request ends (completed or a clear error), none hangs past its
deadline, and the stack serves again within seconds."""

import asyncio
import shutil
import signal
import time

import aiohttp
import pytest

from services.gateway.auth import hash_key
from shared import keys, protocol
from shared.bus import Bus
from tests.fault.conftest import Load, make_stack, metric, start_gateway, stream_completion

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("infra-loss-logs"), schedulers=2)
    _, s.second_gateway = start_gateway(s, "gateway-1")
    yield s
    s.stop()


def infra_process(stack, name: str):
    return next(p for p in stack.infra.processes if p.name == name)


async def restart(stack, name: str, before_stop=None, down_for: float = 1.0, empty: bool = False) -> float:
    """SIGKILL the NATS or Valkey server and start it again on the same port (empty: Valkey
    without its data); returns when it is back (time.monotonic())."""
    managed = infra_process(stack, name)
    if before_stop is not None:
        await before_stop()
    managed.proc.send_signal(signal.SIGKILL)
    managed.proc.wait(10)
    stack.infra.processes.remove(managed)
    if empty:
        shutil.rmtree(stack.infra.valkey_dir(managed.port))
    await asyncio.sleep(down_for)
    start = stack.infra.start_nats if name == "nats" else stack.infra.start_valkey
    await asyncio.to_thread(start, 20.0, managed.port)
    return time.monotonic()


async def index_matches_snapshots(stack, redis, bus) -> bool:
    """The prefix index holds exactly what every engine's snapshot says it caches."""
    for replica in ("engine-0", "engine-1"):
        reply = await bus.request(protocol.engine_kv_snapshot(replica), protocol.KvSnapshotRequest(), timeout=5)
        snapshot = protocol.decode(protocol.KvSnapshot, reply.data)
        indexed = {int(h) for h in await redis.smembers(keys.replica_blocks(MODEL, replica))}
        if indexed != set(snapshot.block_hashes):
            return False
    return True


async def wait_until(condition, what: str, timeout: float) -> float:
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout, what
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def test_the_stack_serves_through_both_gateways(stack):
    async with aiohttp.ClientSession() as http:
        for url in (stack.base_url, stack.second_gateway):
            out = await stream_completion(http, url, stack.api_key, {"model": MODEL, "prompt": "hello", "max_tokens": 4})
            assert out.ok, out


@pytest.mark.slow
async def test_valkey_restarted_with_its_data_under_load_costs_no_request(stack, redis):
    """Valkey restarts with its data (its append-only file, as `strata up` runs it): routing
    degrades to load alone while it is away, and KV events lost meanwhile make the index resync."""
    async with Load([stack.base_url, stack.second_gateway], stack.api_key, concurrency=8) as load:
        await asyncio.sleep(3)
        await restart(stack, "valkey")
        await redis.connection_pool.disconnect()  # the test's own connections: not what is under test
        await asyncio.sleep(6)
    errors = [r.outcome for r in load.records if not r.outcome.ok]
    print(f"\nvalkey restart with data: {load.summary()}")
    assert not errors and len(load.records) >= 16, errors[:5]
    bus = await Bus.connect(stack.infra.nats_url_as("admin"), "test-valkey")
    try:
        took = await wait_until(lambda: index_matches_snapshots(stack, redis, bus), "index never recovered", 15)
    finally:
        await bus.close()
    print(f"prefix index equal to the engines' snapshots {took:.1f}s after the load stopped")
    assert await redis.exists(keys.replica("engine-0")) and await redis.exists(keys.replica("engine-1"))


@pytest.mark.slow
async def test_valkey_restarted_empty_rebuilds_the_registry_and_the_index(stack, redis):
    """Everything in Redis is lost: heartbeats re-register the replicas within a second or two,
    the schedulers rebuild the prefix index from the engines' snapshots without waiting for a KV
    event, and the gateways write back the API keys they knew (an empty store is an outage, not
    a revocation)."""
    async with aiohttp.ClientSession() as http:  # something cached on the engines
        for i in range(4):
            out = await stream_completion(http, stack.base_url, stack.api_key,
                                          {"model": MODEL, "prompt": f"Index me {i} " * 20, "max_tokens": 2})
            assert out.ok
    await restart(stack, "valkey", down_for=0.5, empty=True)
    back = time.monotonic()
    await redis.connection_pool.disconnect()
    async def registered() -> bool:
        return await redis.exists(keys.replica("engine-0"), keys.replica("engine-1")) == 2
    took = await wait_until(registered, "replicas not registered again", 5)
    bus = await Bus.connect(stack.infra.nats_url_as("admin"), "test-valkey")
    try:
        await wait_until(lambda: index_matches_snapshots(stack, redis, bus), "index never rebuilt", 10)
    finally:
        await bus.close()
    indexed = await redis.scard(keys.replica_blocks(MODEL, "engine-0")) + await redis.scard(
        keys.replica_blocks(MODEL, "engine-1"))
    print(f"\nvalkey restart empty: registry back in {took:.1f}s, index rebuilt ({indexed} blocks) "
          f"{time.monotonic() - back:.1f}s after the restart")
    assert indexed > 0
    async with aiohttp.ClientSession() as http:
        for url in (stack.base_url, stack.second_gateway):  # the key the gateways knew serves on
            out = await stream_completion(http, url, stack.api_key, {"model": MODEL, "prompt": "again"})
            assert out.ok, out
    assert await redis.exists(keys.api_key(hash_key(stack.api_key)))  # written back
    assert await metric(stack.base_url, "strata:gateway_store_data_losses") >= 1


@pytest.mark.slow
async def test_nats_restarted_under_load_every_request_ends_and_service_resumes(stack):
    async with Load([stack.base_url, stack.second_gateway], stack.api_key, concurrency=8, timeout=20) as load:
        await asyncio.sleep(3)
        killed = time.monotonic()
        back = await restart(stack, "nats")

        async def served_again() -> bool:
            return any(r.outcome.ok and r.started > back for r in load.records)
        recovered = await wait_until(served_again, "no request completed after the restart", 30)
        await asyncio.sleep(5)
        steady = time.monotonic()
        await asyncio.sleep(5)
    resumed = sum([await metric(url, "strata:gateway_migrations_total", outcome="migrated", reason="bus_outage")
                   for url in (stack.base_url, stack.second_gateway)])
    print(f"\nnats restart: {load.summary()}; down {back - killed:.1f}s, serving again {recovered:.1f}s after it "
          f"was back; {resumed:.0f} streams resumed after losing chunks to the outage")
    assert all(r.outcome.status != -1 for r in load.records), "a request hung past its deadline"
    for r in load.records:  # every error is a clear one, in OpenAI's shape
        assert r.outcome.ok or r.outcome.error.get("message"), r
    assert recovered < 10
    after = [r for r in load.records if r.started > steady]
    assert after and all(r.outcome.ok for r in after), [r.outcome.error for r in after if not r.outcome.ok][:5]


@pytest.mark.slow
async def test_a_scheduler_and_a_gateway_killed_under_load_the_others_carry_on(stack, redis):
    async with Load([stack.base_url, stack.second_gateway], stack.api_key, concurrency=8) as load:
        await asyncio.sleep(3)
        killed = time.monotonic()
        stack.services["scheduler-1"].send_signal(signal.SIGKILL)
        stack.services["gateway-1"].send_signal(signal.SIGKILL)
        load.gateways = [stack.base_url]  # clients of the dead gateway go to the other
        await asyncio.sleep(8)
    survivor = [r for r in load.records if r.gateway == stack.base_url]
    print(f"\nscheduler and gateway killed: {load.summary()}")
    assert all(r.outcome.status != -1 for r in load.records), "a request hung past its deadline"
    for r in survivor:  # only requests the dead scheduler held may fail, and clearly
        assert r.outcome.ok or (r.started < killed and "scheduler" in r.outcome.error["message"]), r.outcome
    late = [r for r in survivor if r.started > killed + 1]
    assert len(late) >= 8 and all(r.outcome.ok for r in late)
    # Streams of the dead gateway had nobody to cancel them: they end at max_tokens, nothing leaks.
    for replica in ("engine-0", "engine-1"):
        url = (await redis.hget(keys.replica(replica), "http_url")).decode()
        await wait_until(lambda url=url: _idle(url), f"{replica} still busy", 30)


async def _idle(url: str) -> bool:
    return await metric(url, "strata:num_requests_running") == 0 and await metric(url, "strata:kv_cache_usage_perc") == 0
