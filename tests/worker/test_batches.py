"""One message per step per gateway: requests that name `batch_to` get their chunks in one
TokenChunkBatch per step on that subject; the others per request on reply_to. A real engine
process with the tiny model, a real NATS; two plain subscribers stand for two gateways."""

import asyncio
import json
import time
import uuid
from collections import defaultdict

import pytest

from shared import keys, protocol
from shared.bus import Bus
from shared.protocol import Cancel, GenerateAck, GenerateRequest, Heartbeat, TokenChunk, TokenChunkBatch
from tests.helpers import new_request, start_worker, wait_registered

MAX_MODEL_LEN = 512  # below the tiny model's 2048: the engine advertises the smaller


@pytest.fixture(scope="module")
async def worker(infra, tiny_model_dir, tmp_path_factory, redis):
    # 5 ms a step: long streams stay open long enough to be cancelled or to meet a deadline.
    w = start_worker(infra, tiny_model_dir, tmp_path_factory.mktemp("w"), "w-batches", "--num-kv-blocks", "512",
                     "--max-model-len", str(MAX_MODEL_LEN), "--debug-step-delay", "0.005")
    await wait_registered(redis, w)
    yield w
    w.kill9()


class Wire:
    """Everything the engine sends for a set of requests: each gateway's batches (a plain
    subscription on its batch subject) and each request's own subjects."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.batches: dict[str, list[TokenChunkBatch]] = defaultdict(list)  # batch subject -> batches, as they came
        self.alone: dict[str, list[TokenChunk]] = defaultdict(list)  # request id -> chunks on its reply_to
        self.acks: dict[str, list[GenerateAck]] = defaultdict(list)  # request id -> acks on accepted(reply_to)
        self.subs = []
        self.finals: dict[str, int] = defaultdict(int)
        self.changed = asyncio.Event()

    async def gateway(self, name: str) -> str:
        subject = f"_INBOX.test.{name}.{uuid.uuid4().hex[:8]}"

        async def on_batch(msg):
            batch = protocol.decode(TokenChunkBatch, msg.data)
            self.batches[subject].append(batch)
            self._count(batch.chunks)

        self.subs.append(await self.bus.nc.subscribe(subject, cb=on_batch))
        return subject

    async def watch(self, req: GenerateRequest) -> None:
        async def on_chunk(msg):
            chunk = protocol.decode(TokenChunk, msg.data)
            self.alone[chunk.request_id].append(chunk)
            self._count([chunk])

        async def on_ack(msg):
            ack = protocol.decode(GenerateAck, msg.data)
            self.acks[ack.request_id].append(ack)

        self.subs.append(await self.bus.nc.subscribe(req.reply_to, cb=on_chunk))
        self.subs.append(await self.bus.nc.subscribe(protocol.accepted(req.reply_to), cb=on_ack))

    def _count(self, chunks: list[TokenChunk]) -> None:
        for c in chunks:
            self.finals[c.request_id] += c.is_final
        self.changed.set()

    async def until_final(self, request_ids, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.finals[r] for r in request_ids):
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(deadline - time.monotonic(), 0.01))
        await asyncio.sleep(0.3)  # anything sent after a final would have come by now

    def batched(self, subject: str) -> dict[str, list[TokenChunk]]:
        """Request id -> its chunks from the batches on `subject`, in the order they came."""
        out: dict[str, list[TokenChunk]] = defaultdict(list)
        for batch in self.batches[subject]:
            for c in batch.chunks:
                out[c.request_id].append(c)
        return out

    async def close(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()


def assert_one_stream(chunks: list[TokenChunk]) -> None:
    """Each chunk once, in order, and exactly one final, last."""
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum(c.is_final for c in chunks) == 1 and chunks[-1].is_final


async def send(bus, worker, requests) -> None:
    subject = protocol.engine_generate(worker.replica_id)
    await asyncio.gather(*(bus.publish(subject, r) for r in requests))


async def test_a_batch_for_two_gateways_reaches_each_once(bus, worker):
    wire = Wire(bus)
    gw_a, gw_b = await wire.gateway("gw-a"), await wire.gateway("gw-b")
    prompts = [f"Gateway stream {i} says" for i in range(7)]
    for_a = [new_request(p, max_tokens=12 + 3 * i, ignore_eos=True, temperature=0.0) for i, p in enumerate(prompts[:4])]
    for_b = [new_request(p, max_tokens=10 + 4 * i, ignore_eos=True, temperature=0.0) for i, p in enumerate(prompts[4:])]
    for r in for_a:
        r.batch_to = gw_a
    for r in for_b:
        r.batch_to = gw_b
    # Callers that are not gateways: the same prompts as a request of each gateway, per request.
    plain = [new_request(for_a[0].prompt, max_tokens=for_a[0].sampling.max_tokens, ignore_eos=True, temperature=0.0),
             new_request(for_b[0].prompt, max_tokens=for_b[0].sampling.max_tokens, ignore_eos=True, temperature=0.0)]
    everyone = for_a + for_b + plain
    try:
        for r in everyone:
            await wire.watch(r)
        await send(bus, worker, everyone)
        await wire.until_final([r.request_id for r in everyone])

        for subject, mine in ((gw_a, for_a), (gw_b, for_b)):
            got = wire.batched(subject)
            assert set(got) == {r.request_id for r in mine}  # its own requests only, every one of them
            for r in mine:
                assert_one_stream(got[r.request_id])
                assert sum(len(c.token_ids) for c in got[r.request_id]) == r.sampling.max_tokens
                assert got[r.request_id][-1].finish_reason == "length"
                assert not wire.alone[r.request_id]  # nothing per request for a gateway's request
                assert [a.accepted for a in wire.acks[r.request_id]] == [True]  # acks as before
            batches = wire.batches[subject]
            assert all(b.replica_id == worker.replica_id for b in batches)
            # One message per step: the streams ran together, so batches held several requests.
            assert len(batches) < sum(len(v) for v in got.values())
            assert max(len({c.request_id for c in b.chunks}) for b in batches) == len(mine)

        for r, twin in zip(plain, (for_a[0], for_b[0])):
            chunks = wire.alone[r.request_id]
            assert_one_stream(chunks)
            assert [a.accepted for a in wire.acks[r.request_id]] == [True]
            twin_chunks = wire.batched(twin.batch_to)[twin.request_id]
            assert [t for c in chunks for t in c.token_ids] == [t for c in twin_chunks for t in c.token_ids]
            assert "".join(c.text for c in chunks) == "".join(c.text for c in twin_chunks)
        for r in plain:  # and nothing of theirs in any batch
            assert all(c.request_id != r.request_id for b in wire.batches[gw_a] + wire.batches[gw_b] for c in b.chunks)
    finally:
        await wire.close()


async def test_batched_requests_end_in_one_final_message_in_their_batch(bus, worker):
    """A deadline, a withdrawal by its scheduler and a cancel, among requests that finish: each
    ends once, in the batch; the withdrawal's refusal still comes on accepted(reply_to)."""
    wire = Wire(bus)
    gw = await wire.gateway("gw-errors")
    done = new_request("Finishes normally", max_tokens=30, ignore_eos=True)
    late = new_request("Meets its deadline " * 3, max_tokens=400, ignore_eos=True)
    late.deadline = time.time() + 0.4
    withdrawn = new_request("Withdrawn mid stream", max_tokens=400, ignore_eos=True)
    cancelled = new_request("Cancelled mid stream", max_tokens=400, ignore_eos=True)
    requests = [done, late, withdrawn, cancelled]
    for r in requests:
        r.batch_to = gw
    try:
        for r in requests:
            await wire.watch(r)
        await send(bus, worker, requests)
        started = time.monotonic()
        while len(wire.batched(gw)[withdrawn.request_id]) < 3 or len(wire.batched(gw)[cancelled.request_id]) < 3:
            assert time.monotonic() - started < 30, "the streams did not start"
            await asyncio.sleep(0.01)
        await bus.publish(protocol.CANCEL, Cancel(request_id=withdrawn.request_id, replica_id=worker.replica_id))
        await bus.publish(protocol.CANCEL, Cancel(request_id=cancelled.request_id))
        await wire.until_final([r.request_id for r in requests])

        got = wire.batched(gw)
        for r in requests:
            assert_one_stream(got[r.request_id])
            assert not wire.alone[r.request_id]
        assert got[done.request_id][-1].finish_reason == "length"
        assert got[late.request_id][-1].error.code == protocol.ErrorCode.DEADLINE_EXCEEDED
        assert got[withdrawn.request_id][-1].error.code == protocol.ErrorCode.UNAVAILABLE
        assert [a.accepted for a in wire.acks[withdrawn.request_id]] == [True, False]
        assert got[cancelled.request_id][-1].finish_reason == "abort"
    finally:
        await wire.close()


async def test_heartbeat_and_registry_advertise_the_engines_limits(bus, worker, redis, tiny_model_dir):
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    got = asyncio.get_running_loop().create_future()

    async def on(msg):
        if not got.done():
            got.set_result(protocol.decode(Heartbeat, msg.data))

    sub = await bus.nc.subscribe(protocol.heartbeat(worker.replica_id), cb=on)
    try:
        hb = await asyncio.wait_for(got, 5)
    finally:
        await sub.unsubscribe()
    assert (hb.max_model_len, hb.vocab_size) == (MAX_MODEL_LEN, vocab_size)
    entry = await redis.hgetall(keys.replica(worker.replica_id))
    assert (int(entry[b"max_model_len"]), int(entry[b"vocab_size"])) == (MAX_MODEL_LEN, vocab_size)
