"""Several choices when a replica is lost mid-stream: a stream of n > 1 choices (one engine
request) ends with exactly one in-band error, never a hang; each prompt of a batch is an engine
request of its own and continues on the other replica with the output of a fault-free run."""

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from tests.fault.conftest import make_stack
from tests.fault.test_engine_loss import engine_running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("choices-migration-logs"))
    yield s
    s.stop()


async def read_stream(http, stack, body: dict, seen: list[int]) -> tuple[dict[int, str], list[dict]]:
    """(text per choice index, in-band errors) of a streamed completion; seen[0] counts events."""
    texts, errors = {}, []
    headers = {"Authorization": f"Bearer {stack.api_key}", "Strata-Timeout": "90"}
    async with http.post(stack.base_url + "/v1/completions", json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            seen[0] += 1
            if "error" in event:
                errors.append(event["error"])
                continue
            for choice in event["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, errors


async def the_busier(stack) -> str:
    running = {r: await engine_running(stack, r) for r in ("engine-0", "engine-1")}
    return max(running, key=running.get)


async def test_n_stream_fails_once_and_batch_prompts_migrate(stack):
    body = {"model": "tiny-llama", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        # n = 2 on one replica: frozen mid-stream, the stream ends with one error.
        seen = [0]
        task = asyncio.create_task(read_stream(http, stack, {**body, "prompt": "Two tales", "n": 2}, seen))
        while seen[0] < 10:
            assert not task.done(), task.result()
            await asyncio.sleep(0.02)
        frozen = await the_busier(stack)
        stack.services[frozen].send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            texts, errors = await asyncio.wait_for(task, 60)
        finally:
            stack.services[frozen].send_signal(signal.SIGCONT)
        assert len(errors) == 1 and errors[0]["code"] == "unavailable", errors
        assert "n > 1" in errors[0]["message"] and time.monotonic() - start < 30
        assert set(texts) == {0, 1}

        await asyncio.sleep(4)  # the thawed replica is heard again
        prompts = ["The first of the batch", "The second of the batch"]
        reference, _ = await read_stream(http, stack, {**body, "prompt": prompts}, [0])
        seen = [0]
        task = asyncio.create_task(read_stream(http, stack, {**body, "prompt": prompts}, seen))
        while seen[0] < 20:
            assert not task.done(), task.result()
            await asyncio.sleep(0.02)
        frozen = await the_busier(stack)
        stack.services[frozen].send_signal(signal.SIGSTOP)
        try:
            texts, errors = await asyncio.wait_for(task, 90)
        finally:
            stack.services[frozen].send_signal(signal.SIGCONT)
    assert errors == []
    assert texts == reference  # each prompt's stream continued elsewhere exactly
