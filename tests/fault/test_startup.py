"""Startup is not a race: requests that arrive while the first engine is still starting (its
process importing, its model loading) wait for it within their deadline and are served; none
gets "no replica is running"."""

import asyncio
import time

import aiohttp
import pytest

from tests.fault.conftest import make_stack, stream_completion

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    # The gateway and scheduler are up; no engine yet. (The scheduler waits for a model nobody
    # serves yet for 30 s here, not 10: this machine starts a Python process slowly under load.)
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("startup-logs"), engines=0,
                   scheduler_args=["--no-replica-wait", "30"])
    yield s
    s.stop()


@pytest.mark.slow
async def test_requests_before_the_first_engine_is_ready_wait_for_it(stack):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def client(i: int):
            return await stream_completion(http, stack.base_url, stack.api_key,
                                           {"model": MODEL, "prompt": f"early {i}", "max_tokens": 4}, timeout=90)
        early = [asyncio.create_task(client(i)) for i in range(4)]  # before the engine process exists
        await asyncio.sleep(0.5)
        started = time.monotonic()
        stack.start_engine("engine-0")
        during = []
        while not all(t.done() for t in early):  # and more while it imports and loads its model
            during.append(asyncio.create_task(client(100 + len(during))))
            await asyncio.sleep(0.5)
            assert time.monotonic() - started < 100, "the engine never served"
        results = await asyncio.gather(*early, *during)
    took = time.monotonic() - started
    print(f"\nengine started; {len(results)} requests made while it started, all answered {took:.1f}s later")
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert len(during) >= 2
