"""A request held in a scheduler's admission queue when that scheduler dies ends with an error
from the gateway (not silence until its deadline); requests already on an engine finish."""

import asyncio
import time

import aiohttp
import pytest

from shared.localstack import LocalStack


@pytest.fixture
def slow_stack(tiny_model_dir, tmp_path):
    # One engine with room for one request at a time, slowed down: the scheduler must queue.
    # Its own NATS and Valkey: no other test's scheduler may take (or vouch for) its requests.
    s = LocalStack(str(tiny_model_dir), engines=1,
                   engine_args=["--max-num-seqs", "1", "--debug-step-delay", "0.03", "--num-kv-blocks", "128"],
                   log_dir=tmp_path, deployment="tiny-slow")
    s.start()
    yield s
    s.stop()


async def complete(http, stack, prompt):
    async with http.post(stack.base_url + "/v1/completions",
                         json={"model": stack.deployment, "prompt": prompt, "max_tokens": 60, "ignore_eos": True},
                         headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
        return resp.status, await resp.json()


async def test_requests_held_by_a_dead_scheduler_end_with_an_error(slow_stack):
    await asyncio.sleep(1.5)  # the gateway has seen the scheduler's stats
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        running = [asyncio.create_task(complete(http, slow_stack, f"first {i}")) for i in range(2)]
        await asyncio.sleep(0.5)  # both reached the engine: one runs, one waits there
        held = asyncio.create_task(complete(http, slow_stack, "held in the scheduler's queue"))
        await asyncio.sleep(0.5)
        slow_stack.services["scheduler-0"].kill()
        killed = time.monotonic()
        status, body = await held
        assert status == 503 and "died" in body["error"]["message"]
        assert time.monotonic() - killed < 5.0  # not the 600 s deadline
        for task in running:
            status, body = await task
            assert status == 200 and body["usage"]["completion_tokens"] == 60
