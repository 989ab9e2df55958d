"""A busy replica still beats: heartbeats come from a thread of their own, so a worker whose
event loop is stuck (a flood of messages, a CPU-starved process) keeps its heartbeats and its
registry lease, and they carry the evidence that its engine progresses (steps_total)."""

import asyncio
import time

from services.engine.service import EngineWorker, WorkerConfig
from shared import keys, protocol
from shared.bus import Bus
from shared.protocol import Heartbeat
from shared.store import connect_redis
from tests.helpers import new_request


async def test_heartbeats_and_progress_go_on_while_the_event_loop_is_stuck(infra, tiny_model_dir):
    cfg = WorkerConfig(model_dir=str(tiny_model_dir), replica_id="w-liveness", deployment="tiny",
                       nats_url=infra.nats_url, redis_url=infra.redis_url, lease_ttl=2.0, heartbeat_interval=0.5,
                       engine_args={"num_kv_blocks": 256, "debug_step_delay_s": 0.02, "num_threads": 1})
    worker = EngineWorker(cfg)
    bus = await Bus.connect(infra.nats_url, "liveness-observer")
    redis = connect_redis(infra.redis_url)
    beats: list[Heartbeat] = []

    async def on_beat(msg):
        beats.append(protocol.decode(Heartbeat, msg.data))
    await bus.nc.subscribe(protocol.heartbeat(cfg.replica_id), cb=on_beat)
    try:
        await worker.start()
        stream = await bus.nc.subscribe(f"_INBOX.liveness.{time.time_ns()}")
        req = new_request(list(range(10, 40)), max_tokens=1500, temperature=0.0, ignore_eos=True)
        req.reply_to = stream.subject
        await bus.publish(protocol.engine_generate(cfg.replica_id), req)
        await asyncio.sleep(1.0)  # running
        stuck_at = time.time()
        time.sleep(4.0)  # the worker's event loop (this one) is stuck: nothing on it runs
        unstuck_at = time.time()
        await asyncio.sleep(1.0)  # what was sent meanwhile arrives
        during = [hb for hb in beats if stuck_at < hb.timestamp < unstuck_at]
        assert len(during) >= 5, [hb.timestamp - stuck_at for hb in beats]  # every 0.5 s, loop or no loop
        assert all(hb.state == "ready" for hb in during)
        assert during[-1].steps_total > during[0].steps_total  # and the engine kept stepping
        assert await redis.exists(keys.replica(cfg.replica_id))  # the 2 s lease never lapsed
        await bus.publish(protocol.CANCEL, protocol.Cancel(request_id=req.request_id))
    finally:
        await worker.drain()
        await bus.close()
        await redis.aclose()


async def test_a_starting_engine_is_on_the_bus_before_its_model_loads(infra, tiny_model_dir):
    """Its first heartbeats say `starting` (schedulers hold its requests instead of refusing)."""
    cfg = WorkerConfig(model_dir=str(tiny_model_dir), replica_id="w-starting", deployment="tiny-starting",
                       nats_url=infra.nats_url, redis_url=infra.redis_url, heartbeat_interval=0.2,
                       engine_args={"num_kv_blocks": 64, "num_threads": 1})
    bus = await Bus.connect(infra.nats_url, "starting-observer")
    states: list[str] = []

    async def on_beat(msg):
        states.append(protocol.decode(Heartbeat, msg.data).state)
    await bus.nc.subscribe(protocol.heartbeat(cfg.replica_id), cb=on_beat)
    worker = EngineWorker(cfg)
    try:
        await worker.start()
        await asyncio.sleep(0.5)
    finally:
        await worker.drain()
        await bus.close()
    assert states and states[0] == "starting" and "ready" in states, states
