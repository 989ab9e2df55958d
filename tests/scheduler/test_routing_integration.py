"""KV-aware routing with real NATS, Valkey, three engine workers and two schedulers."""

import asyncio
import random
import time

import aiohttp
import pytest

from shared import keys, protocol
from shared.block_hash import prompt_block_hashes
from shared.bus import Bus
from shared.localstack import LocalStack
from shared.store import connect_redis
from tests.helpers import new_request, stream_request

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def stack(infra, tiny_model_dir, tmp_path_factory):
    s = LocalStack(str(tiny_model_dir), engines=3, schedulers=2, nats_url=infra.nats_url, redis_url=infra.redis_url,
                   engine_args=["--num-kv-blocks", "256", "--lease-ttl", "2"],
                   log_dir=tmp_path_factory.mktemp("routing-logs"))
    s.start()
    time.sleep(1.5)  # every scheduler has heard every engine's heartbeat
    yield s
    s.stop()


@pytest.fixture
async def bus(infra):
    b = await Bus.connect(infra.nats_url, "test-routing")
    yield b
    await b.close()


@pytest.fixture
async def redis(infra):
    r = connect_redis(infra.redis_url)
    yield r
    await r.aclose()


def request(tokens, max_tokens=4):
    req = new_request(tokens, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    req.model = MODEL
    return req


async def run(bus, tokens, max_tokens=4):
    chunks = await stream_request(bus, protocol.GENERATE, request(tokens, max_tokens))
    assert chunks[-1].finish_reason == "length", chunks[-1]
    return chunks[-1]


async def wait_indexed(redis, replica_id, tokens, timeout=5.0):
    """Until the index says replica_id holds every full block of tokens."""
    wanted = {str(h).encode() for h in prompt_block_hashes(tokens, 16)}
    deadline = time.monotonic() + timeout
    while not wanted <= await redis.smembers(keys.replica_blocks(MODEL, replica_id)):
        assert time.monotonic() < deadline, "KV events never reached the index"
        await asyncio.sleep(0.05)


async def test_a_repeated_long_prefix_lands_on_the_replica_that_holds_it(stack, bus, redis):
    rng = random.Random(7)
    prefix = [rng.randrange(8, 4000) for _ in range(320)]  # 20 blocks
    first = await run(bus, prefix + [11, 12])
    await wait_indexed(redis, first.replica_id, prefix)
    for i in range(6):
        final = await run(bus, prefix + [rng.randrange(8, 4000) for _ in range(5 + i)])
        assert final.replica_id == first.replica_id
        assert final.usage.cached_tokens >= 320


async def test_distinct_prefixes_spread_over_replicas(stack, bus):
    rng = random.Random(11)
    finals = await asyncio.gather(*(run(bus, [rng.randrange(8, 4000) for _ in range(200)], max_tokens=30)
                                    for _ in range(12)))
    assert len({f.replica_id for f in finals}) == 3


async def test_scheduler_metrics(stack, bus):
    urls: dict[str, str] = {}

    async def on_stats(msg):
        stats = protocol.decode(protocol.SchedulerStats, msg.data)
        urls[stats.scheduler_id] = stats.http_url

    sub = await bus.nc.subscribe(protocol.SCHEDULER_STATS_ALL, cb=on_stats)
    deadline = time.monotonic() + 5
    while len(urls) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await sub.unsubscribe()
    assert set(urls) == {"scheduler-0", "scheduler-1"}
    texts = []
    async with aiohttp.ClientSession() as http:
        for url in urls.values():
            async with http.get(url + "/health") as resp:
                assert resp.status == 200
            async with http.get(url + "/metrics") as resp:
                texts.append(await resp.text())
    for name in ("strata:scheduler_decisions_total", "strata:scheduler_kv_event_batches_total",
                 "strata:scheduler_queue_depth", "strata:scheduler_retries_total"):
        assert all(name in text for text in texts), name
    # The two schedulers shared the earlier tests' requests: together they routed them by kv_aware.
    routed = [line for text in texts for line in text.splitlines()
              if line.startswith("strata:scheduler_decisions_total{") and 'policy="kv_aware"' in line
              and 'outcome="routed"' in line]
    assert routed and sum(float(line.rsplit(" ", 1)[1]) for line in routed) >= 7
    assert any("strata:scheduler_matched_prefix_fraction_bucket" in text for text in texts)


async def index_holders_of(redis, replica_id) -> int:
    count = 0
    async for key in redis.scan_iter(match=keys.prefix_block(MODEL, 0)[:-1] + "*", count=1000):
        if replica_id.encode() in await redis.smembers(key):
            count += 1
    return count


async def test_an_indexer_that_missed_events_resyncs_from_the_snapshot(stack, bus, redis):
    rng = random.Random(3)
    await run(bus, [rng.randrange(8, 4000) for _ in range(100)])
    await asyncio.sleep(0.3)
    # Lose the index of every replica, as after a Valkey restart or an indexer that was down.
    for i in range(3):
        rid = f"engine-{i}"
        await redis.delete(keys.replica_blocks_seq(MODEL, rid))
        async for key in redis.scan_iter(match=keys.prefix_block(MODEL, 0)[:-1] + "*", count=1000):
            await redis.srem(key, rid)
        await redis.delete(keys.replica_blocks(MODEL, rid))
    final = await run(bus, [rng.randrange(8, 4000) for _ in range(100)])  # its events reveal the gap
    holder = final.replica_id
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        indexed = {int(h) for h in await redis.smembers(keys.replica_blocks(MODEL, holder))}
        snapshot = protocol.decode(protocol.KvSnapshot, (await bus.request(
            protocol.engine_kv_snapshot(holder), protocol.KvSnapshotRequest(), timeout=5)).data)
        if indexed and indexed == set(snapshot.block_hashes):
            break
        await asyncio.sleep(0.1)
    assert indexed == set(snapshot.block_hashes) and len(indexed) > 6


async def test_killing_a_scheduler_under_load_loses_nothing_beyond_what_it_held(stack, bus):
    """Through the gateway: requests the dead scheduler held end with an error (the gateway
    notices the scheduler is gone), every other request completes, and none hangs."""
    rng = random.Random(5)

    async def one(http):
        body = {"model": MODEL, "prompt": [rng.randrange(8, 4000) for _ in range(50)], "max_tokens": 20,
                "ignore_eos": True}
        async with http.post(stack.base_url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
            return resp.status, await resp.json()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        tasks = [asyncio.create_task(one(http)) for _ in range(20)]
        await asyncio.sleep(0.05)
        stack.services["scheduler-1"].kill()
        stack.services.pop("scheduler-1").wait(10)
        results = await asyncio.gather(*tasks)  # a hung request would time out here
        assert all(status in (200, 503) for status, _ in results), results
        assert all(body["usage"]["completion_tokens"] == 20 for status, body in results if status == 200)
        assert all("error" in body for status, body in results if status == 503)
        more = await asyncio.gather(*(one(http) for _ in range(10)))
    assert all(status == 200 for status, _ in more)  # the survivor takes everything now


async def test_a_killed_replica_leaves_routing_and_the_index_within_its_lease(stack, bus, redis):
    rng = random.Random(9)
    tokens = [rng.randrange(8, 4000) for _ in range(150)]
    victim = (await run(bus, tokens)).replica_id
    await wait_indexed(redis, victim, tokens)
    stack.services[victim].kill()
    stack.services.pop(victim).wait(10)
    killed = time.monotonic()
    while await redis.exists(keys.replica_blocks(MODEL, victim)) or await redis.exists(keys.replica(victim)):
        assert time.monotonic() - killed < 2.0 + 2.5, "replica still registered or indexed"
        await asyncio.sleep(0.1)
    assert await index_holders_of(redis, victim) == 0
    for _ in range(6):  # nothing is routed to it any more
        assert (await run(bus, [rng.randrange(8, 4000) for _ in range(30)])).replica_id != victim
