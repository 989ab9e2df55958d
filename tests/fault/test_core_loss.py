"""An engine core process (engine_core=process) killed with SIGKILL while its replica streams:
the worker knows at once (the core's socket closes), reports the replica `failed` within a
second, and ends each open stream as `unavailable`, so the gateway continues it on the other
replica from the tokens already delivered: greedy output is that of a fault-free run."""

import asyncio
import signal
import time

import aiohttp
import psutil
import pytest

from shared import protocol
from shared.bus import Bus
from tests.fault.conftest import ENGINE_ARGS, make_stack, metric, stream_completion

MAX_TOKENS = 48
PROMPTS = [f"Core {i}: the {['red', 'green', 'blue', 'grey'][i % 4]} fox number {i} said" for i in range(12)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("core-loss-logs"),
                   engine_args=[*ENGINE_ARGS, "--engine-core", "process"])
    yield s
    s.stop()


def body(prompt: str) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def core_process_of(worker_pid: int) -> psutil.Process:
    cores = [p for p in psutil.Process(worker_pid).children()
             if "services.engine.core_process" in " ".join(p.cmdline())]
    assert len(cores) == 1, cores
    return cores[0]


async def test_a_killed_core_fails_its_replica_within_a_second_and_its_streams_migrate(stack):
    bus = await Bus.connect(stack.infra.nats_url_as("admin"), "test-core-loss")
    failed_at = asyncio.get_running_loop().create_future()

    async def on_heartbeat(msg):
        hb = protocol.decode(protocol.Heartbeat, msg.data)
        if hb.state == "failed" and not failed_at.done():
            failed_at.set_result(time.monotonic())

    sub = await bus.nc.subscribe(protocol.heartbeat("engine-0"), cb=on_heartbeat)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
            reference = await asyncio.gather(*(stream_completion(http, stack.base_url, stack.api_key, body(p))
                                               for p in PROMPTS))
            assert all(r.ok for r in reference), [r.error for r in reference if not r.ok]
            progress = [0] * len(PROMPTS)

            def tracker(i):
                def on_event(out):
                    progress[i] = out.events
                return on_event

            streams = [asyncio.create_task(stream_completion(http, stack.base_url, stack.api_key, body(p),
                                                             on_event=tracker(i)))
                       for i, p in enumerate(PROMPTS)]
            deadline = time.monotonic() + 60
            while sum(n >= 6 for n in progress) < len(PROMPTS) // 2:  # half of them well under way
                assert time.monotonic() < deadline, f"streams did not start: {progress}"
                await asyncio.sleep(0.02)
            on_victim = sum(1 for t in streams if not t.done())
            core = core_process_of(stack.services["engine-0"].pid)
            core.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            failed = await asyncio.wait_for(failed_at, 5)
            results = await asyncio.wait_for(asyncio.gather(*streams), timeout=120)
    finally:
        await sub.unsubscribe()
        await bus.close()
    migrated = await metric(stack.base_url, "strata:gateway_migrations_total", outcome="migrated")
    print(f"\ncore killed: replica failed {1e3 * (failed - killed):.0f} ms later; {migrated:.0f} of "
          f"{on_victim} open streams migrated")
    assert failed - killed < 1.0
    assert stack.services["engine-0"].wait(30) == 1  # the worker left the fleet, to be restarted
    for ref, got, prompt in zip(reference, results, PROMPTS):
        assert got.ok, (prompt, got.error)
        assert got.text == ref.text, prompt
        assert got.usage["completion_tokens"] == MAX_TOKENS
        assert got.strata["replica_id"] == "engine-1"
    assert migrated >= 1
