"""An engine replica killed with SIGKILL under load: every stream it held continues on the other
replica from the tokens already delivered (mid-stream migration in the gateway), so greedy
output is exactly that of a fault-free run; requests it held without a token yet complete too.
Frozen replicas (SIGSTOP) move a stream back and forth up to the migration limit, after which
the stream ends with a clear in-band error; nothing outlives its deadline. A replica that drains
(SIGTERM) past its drain timeout hands its streams on the same way."""

import asyncio
import signal
import time

import aiohttp
import pytest

from services.gateway.migration import MAX_MIGRATIONS, REPLICA_DEAD_AFTER
from shared import protocol
from shared.bus import Bus
from tests.fault.conftest import make_stack, metric, stream_completion
from tests.helpers import new_request, stream_request

MAX_TOKENS = 64
PROMPTS = [f"Chapter {i}: the {['red', 'green', 'blue', 'grey'][i % 4]} fox number {i} said" for i in range(36)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("engine-loss-logs"))
    yield s
    s.stop()


def body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def first_difference(expected: str, got: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return f"at {at}: expected ...{expected[max(at - 20, 0):at + 20]!r}, got ...{got[max(at - 20, 0):at + 20]!r}"


async def engine_running(stack, replica: str) -> float:
    import redis.asyncio as aioredis

    from shared import keys
    r = aioredis.Redis.from_url(stack.infra.redis_url)
    try:
        url = (await r.hget(keys.replica(replica), "http_url") or b"").decode()
    finally:
        await r.aclose()
    return await metric(url, "strata:num_requests_running") if url else 0.0


async def test_a_continuation_is_not_routed_to_the_replica_it_left(stack):
    """Even where routing would prefer it (it holds the prompt's prefix), the replica a resumed
    stream left is presumed dead: the continuation goes elsewhere."""
    bus = await Bus.connect(stack.infra.nats_url_as("admin"), "test-resume-routing")
    try:
        prompt = list(range(100, 260))  # ten blocks: the prefix-cache weight outbids the load
        first = (await stream_request(bus, protocol.GENERATE, generate(prompt)))[-1]
        holder = first.replica_id
        again = (await stream_request(bus, protocol.GENERATE, generate(prompt)))[-1]
        assert again.replica_id == holder  # routing follows the cached prefix
        resumed = generate(prompt + first.token_ids[:1])
        resumed.resume = protocol.Resume(request_id="earlier-leg", generated=1, replica_id=holder)
        chunks = await stream_request(bus, protocol.GENERATE, resumed)
    finally:
        await bus.close()
    assert chunks[-1].finish_reason == "length" and chunks[-1].replica_id not in (None, holder), chunks[-1]


@pytest.mark.slow
async def test_a_retry_after_a_frozen_replica_is_not_refused_by_its_own_cancel(stack):
    """SIGSTOP one replica: forwards to it time out, the scheduler withdraws each from that
    replica only (the cancel names it) and retries on the other, which serves it. Before, the
    retry was refused as "cancelled before it arrived" and the client got a 499 (client left)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        prompts = [f"Frozen {i}: the quick brown fox" for i in range(8)]
        reference = await asyncio.gather(*(stream_completion(http, stack.base_url, stack.api_key, body(p, 16))
                                           for p in prompts))
        retries_before = sum([await metric(await scheduler_url(stack), "strata:scheduler_retries_total")])
        stack.services["engine-0"].send_signal(signal.SIGSTOP)
        try:
            results = await asyncio.wait_for(asyncio.gather(*(
                stream_completion(http, stack.base_url, stack.api_key, body(p, 16)) for p in prompts)), 60)
        finally:
            stack.services["engine-0"].send_signal(signal.SIGCONT)
        await asyncio.sleep(2)  # the thawed replica takes the withdrawn forwards, and drops them
    retries = await metric(await scheduler_url(stack), "strata:scheduler_retries_total") - retries_before
    print(f"\nengine-0 frozen: {retries:.0f} forwards timed out and were retried on engine-1")
    assert retries >= 1  # the frozen replica was tried: the path under test ran
    for ref, got in zip(reference, results):
        assert got.ok and got.status == 200, got
        assert got.text == ref.text and got.strata["replica_id"] == "engine-1"
    assert await engine_running(stack, "engine-0") == 0  # the late runs were withdrawn there


@pytest.mark.slow
async def test_a_forged_heartbeat_of_a_replica_nobody_runs_does_not_fail_requests(stack):
    """A heartbeat for a replica that does not exist draws routing to it: nobody serves its
    subject, so the scheduler moves on (no cancel is needed) and the request is served."""
    bus = await Bus.connect(stack.infra.nats_url_as("admin"), "forger")
    stop = asyncio.Event()

    async def forge():
        hb = protocol.Heartbeat(replica_id="ghost-replica", model="tiny-llama", deployment="tiny-llama", state="ready")
        while not stop.is_set():
            hb.timestamp = time.time()
            await bus.publish(protocol.heartbeat("ghost-replica"), hb)
            await asyncio.sleep(0.3)
    forger = asyncio.create_task(forge())
    log_path = stack.log_dir / "scheduler-0.log"
    offset = log_path.stat().st_size
    try:
        await asyncio.sleep(1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            results = []
            end = time.monotonic() + 12  # past the scheduler's 5 s of avoiding a failed replica: tried again
            while time.monotonic() < end:
                results += await asyncio.gather(*(stream_completion(http, stack.base_url, stack.api_key,
                                                                    body(f"Ghost {len(results) + i}", 4))
                                                  for i in range(4)))
    finally:
        stop.set()
        await forger
        await bus.close()
    tried = log_path.read_text(errors="replace")[offset:].count("nobody serves the replica's subject")
    print(f"\nforged heartbeat: the ghost was tried {tried} times; {len(results)} requests")
    assert tried >= 1
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]


async def scheduler_url(stack) -> str:
    import redis.asyncio as aioredis

    from shared import keys
    r = aioredis.Redis.from_url(stack.infra.redis_url)
    try:
        return (await r.hget(keys.service("scheduler", "scheduler-0"), "http_url")).decode()
    finally:
        await r.aclose()


def generate(prompt: list[int]) -> protocol.GenerateRequest:
    req = new_request(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    req.model = "tiny-llama"
    return req


@pytest.mark.slow
async def test_streams_of_a_killed_engine_continue_on_the_other_with_the_same_output(stack):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        reference = await asyncio.gather(*(stream_completion(http, stack.base_url, stack.api_key, body(p))
                                           for p in PROMPTS))
        assert all(r.ok for r in reference), [r.error for r in reference if not r.ok]

        progress = [0] * 32

        def tracker(i):
            def on_event(out):
                progress[i] = out.events
            return on_event

        streams = [asyncio.create_task(stream_completion(http, stack.base_url, stack.api_key, body(p),
                                                         on_event=tracker(i)))
                   for i, p in enumerate(PROMPTS[:32])]
        deadline = time.monotonic() + 60
        while sum(n >= 8 for n in progress) < 16:  # half the streams are well under way
            assert time.monotonic() < deadline, f"streams did not start: {progress}"
            await asyncio.sleep(0.02)
        victim_load = await engine_running(stack, "engine-0")
        # Four more that reach the victim (or not) just before it dies: no token yet.
        late = [asyncio.create_task(stream_completion(http, stack.base_url, stack.api_key, body(p)))
                for p in PROMPTS[32:]]
        await asyncio.sleep(0.05)
        stack.services["engine-0"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams, *late), timeout=120)
        took = time.monotonic() - killed

    migrated = await metric(stack.base_url, "strata:gateway_migrations_total", outcome="migrated")
    failed = await metric(stack.base_url, "strata:gateway_migrations_total", outcome="failed")
    print(f"\nvictim had {victim_load:.0f} running; {migrated:.0f} streams migrated, {failed:.0f} failed; "
          f"all {len(results)} ended {took:.1f}s after the kill")
    for ref, got, prompt in zip(reference, results, PROMPTS):
        assert got.ok, (prompt, got.error)
        assert got.text == ref.text, (prompt, first_difference(ref.text, got.text))
        assert got.usage["completion_tokens"] == MAX_TOKENS
        assert got.usage["prompt_tokens"] == ref.usage["prompt_tokens"]  # the original prompt, not the re-prefill
        assert got.strata["replica_id"] == "engine-1"
    assert victim_load >= 1 and migrated >= victim_load and failed == 0


@pytest.mark.slow
async def test_a_stream_moves_up_to_the_migration_limit_then_ends_with_an_in_band_error(stack):
    """SIGSTOP freezes a replica (its heartbeats stop: presumed dead) and SIGCONT brings it back,
    so one stream can lose its replica again and again."""
    if stack.services["engine-0"].poll() is not None:  # the previous test killed it
        stack.start_engine("engine-0")
        stack.wait_ready(90)
        await asyncio.sleep(1.5)  # the scheduler and the gateway hear it
    migrated_before = await metric(stack.base_url, "strata:gateway_migrations_total", outcome="migrated")
    frozen: list[str] = []

    async def wait_for(condition, what: str, timeout: float = REPLICA_DEAD_AFTER + 20) -> None:
        deadline = time.monotonic() + timeout
        while not await condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.1)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        start = time.monotonic()
        events = [0]  # SSE events the client has read so far
        stream = asyncio.create_task(stream_completion(
            http, stack.base_url, stack.api_key, body("A very long story", 1800), timeout=90,
            on_event=lambda out: events.__setitem__(0, out.events)))
        try:
            running = {}

            async def someone_runs_it() -> bool:
                for r in ("engine-0", "engine-1"):
                    running[r] = await engine_running(stack, r)
                return any(running.values())
            await wait_for(someone_runs_it, "no replica took the stream", 30)
            replica = max(running, key=running.get)
            for n in range(1, MAX_MIGRATIONS + 2):
                mark = events[0]  # the replica running it now has streamed to the client: freeze it
                await wait_for(lambda mark=mark: asyncio.sleep(0, events[0] >= mark + 3), "the stream is stuck")
                stack.services[replica].send_signal(signal.SIGSTOP)
                frozen.append(replica)
                if n > MAX_MIGRATIONS:
                    break

                async def moved(n=n) -> bool:
                    now = await metric(stack.base_url, "strata:gateway_migrations_total", outcome="migrated")
                    return now - migrated_before >= n
                await wait_for(moved, f"migration {n} did not happen")
                stack.services[replica].send_signal(signal.SIGCONT)  # back, but the stream has left it
                frozen.remove(replica)
                replica = "engine-1" if replica == "engine-0" else "engine-0"
            out = await asyncio.wait_for(stream, timeout=60)
        finally:
            for name in frozen:
                stack.services[name].send_signal(signal.SIGCONT)
    assert out.status == 200 and out.error is not None, out
    assert out.error["code"] == "unavailable" and f"moved {MAX_MIGRATIONS} times" in out.error["message"]
    assert out.events > 1 and len(out.text) > 0  # it was mid-stream: the error came in band
    assert time.monotonic() - start < 90  # well within its deadline


@pytest.mark.slow
async def test_a_stream_outliving_its_replicas_drain_continues_elsewhere(stack):
    for name in ("engine-0", "engine-1"):  # SIGCONT'ed by the previous test: both serve
        assert stack.services[name].poll() is None
    prompt = "The drain test begins"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        reference = await stream_completion(http, stack.base_url, stack.api_key, body(prompt, 300))
        left_before = await metric(stack.base_url, "strata:gateway_migrations_total", outcome="migrated",
                                   reason="replica_left")
        events = [0]
        stream = asyncio.create_task(stream_completion(http, stack.base_url, stack.api_key, body(prompt, 300),
                                                       on_event=lambda out: events.__setitem__(0, out.events)))
        while events[0] < 10:
            assert not stream.done(), stream.result()
            await asyncio.sleep(0.02)
        running = {r: await engine_running(stack, r) for r in ("engine-0", "engine-1")}
        draining = max(running, key=running.get)
        stack.services[draining].send_signal(signal.SIGTERM)  # drains for 1 s, then aborts what runs
        out = await asyncio.wait_for(stream, 120)
    left = await metric(stack.base_url, "strata:gateway_migrations_total", outcome="migrated", reason="replica_left")
    assert stack.services[draining].wait(30) == 0
    assert reference.ok and out.ok, out
    assert out.text == reference.text, first_difference(reference.text, out.text)
    assert out.usage["completion_tokens"] == 300 and out.strata["replica_id"] != draining
    assert left - left_before == 1
