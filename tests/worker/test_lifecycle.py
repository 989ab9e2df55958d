"""Worker lifecycle: lease expiry after kill -9, graceful drain on SIGTERM."""

import asyncio
import time

from shared import keys, protocol
from shared.bus import Bus
from shared.protocol import GenerateAck
from shared.store import connect_redis
from tests.helpers import new_request, start_worker, stream_request, wait_registered


async def test_lease_disappears_within_its_ttl_after_kill_9(infra, tiny_model_dir, tmp_path):
    redis = connect_redis(infra.redis_url)
    worker = start_worker(infra, tiny_model_dir, tmp_path, "w-kill", "--lease-ttl", "2", "--num-kv-blocks", "64")
    try:
        await wait_registered(redis, worker)
        worker.kill9()
        killed = time.monotonic()
        while await redis.exists(keys.replica("w-kill")):
            assert time.monotonic() - killed < 3.0, "lease outlived its TTL"
            await asyncio.sleep(0.1)
    finally:
        worker.kill9()
        await redis.aclose()


async def test_sigterm_finishes_in_flight_streams_then_exits_0(infra, tiny_model_dir, tmp_path):
    redis = connect_redis(infra.redis_url)
    bus = await Bus.connect(infra.nats_url, "test-drain")
    # 120 steps of >=20 ms: the streams are still running when the late request arrives,
    # however fast the runtime is.
    worker = start_worker(infra, tiny_model_dir, tmp_path, "w-drain", "--num-kv-blocks", "256",
                          "--debug-step-delay", "0.02")
    try:
        await wait_registered(redis, worker)
        subject = protocol.engine_generate("w-drain")
        requests = [new_request(f"Drain {i} " * 3, max_tokens=120, ignore_eos=True) for i in range(6)]
        started = asyncio.Event()

        async def on_chunk(chunk):
            started.set()

        streams = [asyncio.create_task(stream_request(bus, subject, r, on_chunk=on_chunk)) for r in requests]
        await asyncio.wait_for(started.wait(), 30)
        worker.proc.send_signal(15)
        await asyncio.sleep(0.3)
        # Draining: new work is refused with an error a scheduler can retry elsewhere.
        ack = protocol.decode(GenerateAck, (await bus.request(subject, new_request("late"), timeout=5)).data)
        assert not ack.accepted and ack.error.code == protocol.ErrorCode.UNAVAILABLE
        results = await asyncio.gather(*streams)
        for chunks in results:
            assert chunks[-1].finish_reason == "length"
            assert sum(len(c.token_ids) for c in chunks) == 120
        assert await asyncio.get_running_loop().run_in_executor(None, worker.proc.wait, 30) == 0
        assert not await redis.exists(keys.replica("w-drain"))
    finally:
        worker.kill9()
        await bus.close()
        await redis.aclose()
