"""The engine worker on a real NATS and Valkey, as a real process, with the tiny model."""

import asyncio
import time

import aiohttp
import pytest

from services.engine import LLM, SamplingParams
from shared import keys, protocol
from shared.protocol import (Cancel, ErrorReply, GenerateAck, Heartbeat, KvEventBatch, KvSnapshot,
                             KvSnapshotRequest)
from tests.helpers import new_request, start_worker, stream_request, wait_registered


@pytest.fixture(scope="module")
async def worker(infra, tiny_model_dir, tmp_path_factory, redis):
    w = start_worker(infra, tiny_model_dir, tmp_path_factory.mktemp("w"), "w-main", "--num-kv-blocks", "512",
                     "--lease-ttl", "3")
    entry = await wait_registered(redis, w)
    w.http_url = entry["http_url"]
    yield w
    w.kill9()


def subject(worker):
    return protocol.engine_generate(worker.replica_id)


async def heartbeat_of(bus, replica_id, timeout=5.0) -> Heartbeat:
    got = asyncio.get_running_loop().create_future()

    async def on(msg):
        if not got.done():
            got.set_result(protocol.decode(Heartbeat, msg.data))

    sub = await bus.nc.subscribe(protocol.heartbeat(replica_id), cb=on)
    try:
        return await asyncio.wait_for(got, timeout)
    finally:
        await sub.unsubscribe()


async def test_streamed_tokens_equal_the_offline_api(bus, worker, tiny_model_dir):
    prompts = ["The queue holds", "Größe und Straße", "import asyncio\n"]
    specs = [dict(temperature=0.0), dict(temperature=0.9, seed=42, top_p=0.9), dict(temperature=0.0, logprobs=2)]
    requests = [new_request(p, max_tokens=24, ignore_eos=True, **s) for p, s in zip(prompts, specs)]
    results = await asyncio.gather(*(stream_request(bus, subject(worker), r) for r in requests))
    llm = LLM(tiny_model_dir, num_kv_blocks=512)
    offline = llm.generate(prompts, [SamplingParams(max_tokens=24, ignore_eos=True, **s) for s in specs])
    for chunks, ref in zip(results, offline):
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert sum(c.is_final for c in chunks) == 1 and chunks[-1].is_final
        assert [t for c in chunks for t in c.token_ids] == ref.outputs[0].token_ids
        assert "".join(c.text for c in chunks) == ref.outputs[0].text
        final = chunks[-1]
        assert final.finish_reason == "length"
        assert final.usage.prompt_tokens == len(ref.prompt_token_ids) and final.usage.completion_tokens == 24
        assert {"engine_queue", "engine_prefill", "engine_decode"} <= set(final.timings)
        assert final.replica_id == worker.replica_id
    logprobs = [lp for c in results[2] for lp in c.logprobs]
    assert len(logprobs) == 24 and all(len(lp.top) >= 2 for lp in logprobs)


async def test_repeated_prompt_reports_cached_tokens(bus, worker):
    prompt = list(range(100, 180))
    first = await stream_request(bus, subject(worker), new_request(prompt, max_tokens=4, ignore_eos=True))
    second = await stream_request(bus, subject(worker), new_request(prompt, max_tokens=4, ignore_eos=True))
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == 64  # 4 full blocks of 16; the last token is recomputed


async def test_cancel_mid_stream_frees_blocks_and_spares_other_streams(bus, worker):
    victim = new_request("A long story " * 10, max_tokens=500, ignore_eos=True)
    bystander = new_request("Short", max_tokens=40, ignore_eos=True, temperature=0.0)
    cancelled = asyncio.Event()

    async def cancel_after_tokens(chunk):
        if chunk.seq == 3 and not cancelled.is_set():
            cancelled.set()
            await bus.publish(protocol.CANCEL, Cancel(request_id=victim.request_id))

    results = await asyncio.gather(stream_request(bus, subject(worker), victim, on_chunk=cancel_after_tokens),
                                   stream_request(bus, subject(worker), bystander))
    assert results[0][-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in results[0]) < 500
    assert results[1][-1].finish_reason == "length" and sum(len(c.token_ids) for c in results[1]) == 40
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        hb = await heartbeat_of(bus, worker.replica_id)
        if hb.running == 0 and hb.kv_blocks_used == 0:
            break
    assert hb.kv_blocks_used == 0 and hb.running == 0 and hb.waiting == 0


async def test_cancel_from_another_tenant_is_ignored(bus, worker):
    req = new_request("Tenant test", max_tokens=60, ignore_eos=True)
    req.tenant = "alice"
    sent = asyncio.Event()

    async def foreign_cancel(chunk):
        if chunk.seq == 1 and not sent.is_set():
            sent.set()
            await bus.publish(protocol.CANCEL, Cancel(request_id=req.request_id, tenant="mallory"))

    chunks = await stream_request(bus, subject(worker), req, on_chunk=foreign_cancel)
    assert chunks[-1].finish_reason == "length"


async def test_deadline_ends_the_stream_with_a_clear_error(bus, worker):
    req = new_request("Deadline " * 5, max_tokens=2000, ignore_eos=True)
    req.deadline = time.time() + 0.5
    chunks = await stream_request(bus, subject(worker), req, timeout=10)
    assert chunks[-1].error.code == protocol.ErrorCode.DEADLINE_EXCEEDED
    assert sum(c.is_final for c in chunks) == 1


async def test_ack_on_request_reply_and_refusal_of_bad_requests(bus, worker):
    req = new_request("Ack me", max_tokens=3)
    ack = protocol.decode(GenerateAck, (await bus.request(subject(worker), req, timeout=5)).data)
    assert ack.accepted and ack.replica_id == worker.replica_id
    bad = new_request("", max_tokens=3)
    nack = protocol.decode(GenerateAck, (await bus.request(subject(worker), bad, timeout=5)).data)
    assert not nack.accepted and nack.error.code == protocol.ErrorCode.BAD_REQUEST
    # Without a NATS reply subject, the caller gets the error as the final chunk.
    chunks = await stream_request(bus, subject(worker), new_request("hi", max_tokens=0))
    assert chunks[-1].error.code == protocol.ErrorCode.BAD_REQUEST and "max_tokens" in chunks[-1].error.message


@pytest.mark.parametrize("payload", [b"\xc1", b"", b"\x93\x01\x02\x03", b"\x81\xa1v\x63",
                                     protocol.encode(new_request("x")) [:-3], b"\x00" * 100_000])
async def test_malformed_messages_get_error_replies_and_the_worker_keeps_serving(bus, worker, payload):
    reply = await bus.request(subject(worker), payload, timeout=5)
    assert protocol.decode(ErrorReply, reply.data).error.code == protocol.ErrorCode.BAD_REQUEST
    chunks = await stream_request(bus, subject(worker), new_request("still alive", max_tokens=3, ignore_eos=True))
    assert chunks[-1].finish_reason == "length"


async def test_heartbeat_registry_and_metrics(bus, worker, redis):
    hb = await heartbeat_of(bus, worker.replica_id)
    assert hb.state == "ready" and hb.kv_blocks_total == 512 and hb.model == "tiny"
    ttl = await redis.pttl(keys.replica(worker.replica_id))
    assert 0 < ttl <= 3000
    assert worker.replica_id.encode() in await redis.smembers(keys.model_replicas("tiny"))
    async with aiohttp.ClientSession() as http:
        async with http.get(worker.http_url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["state"] == "ready"
        async with http.get(worker.http_url + "/metrics") as resp:
            text = await resp.text()
    for name in ("strata:time_to_first_token_seconds_bucket", "strata:inter_token_latency_seconds_bucket",
                 "strata:num_requests_running", "strata:num_requests_waiting", "strata:kv_cache_usage_perc",
                 "strata:prefix_cache_queries_total", "strata:prefix_cache_hits_total",
                 "strata:num_preemptions_total", "strata:generation_tokens_total"):
        assert name in text, name


async def test_kv_events_replay_to_the_engines_cached_set(bus, worker):
    batches: list[KvEventBatch] = []

    async def on(msg):
        batches.append(protocol.decode(KvEventBatch, msg.data))

    snap0 = protocol.decode(KvSnapshot, (await bus.request(protocol.engine_kv_snapshot(worker.replica_id),
                                                            KvSnapshotRequest(), timeout=5)).data)
    sub = await bus.nc.subscribe(protocol.kv_events("tiny", worker.replica_id), cb=on)
    await bus.nc.flush()
    # Enough distinct prompts to fill and evict part of the 512-block cache.
    prompts = [[(i * 97 + j) % 4000 + 8 for j in range(200 + i)] for i in range(60)]
    for i in range(0, len(prompts), 10):
        await asyncio.gather(*(stream_request(bus, subject(worker), new_request(p, max_tokens=2, ignore_eos=True))
                               for p in prompts[i:i + 10]))
    snap1 = protocol.decode(KvSnapshot, (await bus.request(protocol.engine_kv_snapshot(worker.replica_id),
                                                            KvSnapshotRequest(), timeout=5)).data)
    await asyncio.sleep(0.2)
    await sub.unsubscribe()
    state = set(snap0.block_hashes)
    applied = [b for b in batches if snap0.seq < b.seq <= snap1.seq]
    assert [b.seq for b in applied] == list(range(snap0.seq + 1, snap1.seq + 1))  # no gaps
    for b in applied:
        state |= {s.block_hash for s in b.stored}
        state -= set(b.removed)
    assert any(b.removed for b in applied)  # eviction happened and was reported
    assert state == set(snap1.block_hashes)
