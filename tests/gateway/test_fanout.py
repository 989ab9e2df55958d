"""The gateway's side of the token path, on a real (authenticated) NATS and Valkey with two real
gateways serving real HTTP clients: every GenerateRequest names the gateway's `batch_to`, and a
TokenChunkBatch published there is fanned out to its requests exactly as chunks sent alone on
their reply subjects; a stream that loses a chunk migrates with its original max_tokens; the
limits a request is checked against are those its replicas advertise.

The test itself speaks the scheduler's and the engine's side of the wire (with their roles'
credentials): it answers each GenerateRequest with a GenerateAck and publishes the chunks, so
what each gateway gets, and when, is exactly known."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from services.gateway.service import GatewayConfig, GatewayService
from shared import protocol
from shared.bus import Bus
from shared.localstack import LocalInfra
from shared.protocol import GenerateAck, GenerateRequest, Heartbeat, TokenChunk, TokenChunkBatch, Usage
from tests.fault.conftest import stream_completion

MODEL = "tiny"
REPLICA = "engine-under-test"


@pytest.fixture(scope="module")
def auth_infra():
    infra = LocalInfra(auth=True).start()
    yield infra
    infra.stop()


class Wire:
    """The scheduler (answers GENERATE, records each request) and the engine (publishes chunks,
    batches and heartbeats), each connected with its own role."""

    def __init__(self, scheduler: Bus, engine: Bus):
        self.scheduler, self.engine = scheduler, engine
        self.requests: asyncio.Queue[GenerateRequest] = asyncio.Queue()
        self.refusal: str | None = None  # set: the scheduler refuses requests as malformed (ErrorReply)

    @classmethod
    async def connect(cls, infra) -> "Wire":
        scheduler = await Bus.connect(infra.nats_url, "test-scheduler", auth=infra.nats_auth("scheduler"))
        engine = await Bus.connect(infra.nats_url, "test-engine", auth=infra.nats_auth("engine"))
        wire = cls(scheduler, engine)

        async def on_generate(msg) -> None:
            req = protocol.decode(GenerateRequest, msg.data)
            if wire.refusal is not None:  # as shared.bus answers a message its handler refuses
                await scheduler.reply_error(msg, protocol.ErrorCode.BAD_REQUEST, wire.refusal, req.request_id)
                return
            await msg.respond(protocol.encode(GenerateAck(req.request_id, "scheduler-under-test", True)))
            wire.requests.put_nowait(req)
        await scheduler.nc.subscribe(protocol.GENERATE, cb=on_generate)
        await scheduler.nc.flush()
        return wire

    async def taken(self, n: int, replica: str = REPLICA) -> list[GenerateRequest]:
        """The next n requests the gateways submitted; the replica accepts each."""
        out = [await asyncio.wait_for(self.requests.get(), 30) for _ in range(n)]
        for req in out:
            await self.engine.publish(protocol.accepted(req.reply_to), GenerateAck(req.request_id, replica, True))
        return out

    async def beat(self, **limits) -> None:
        await self.engine.publish(protocol.heartbeat(REPLICA), Heartbeat(
            replica_id=REPLICA, model=MODEL, deployment=MODEL, state="ready", timestamp=time.time(), **limits))
        await self.engine.nc.flush()

    async def close(self) -> None:
        await self.scheduler.close()
        await self.engine.close()


def chunk(req: GenerateRequest, seq: int, token: int, final: bool = False, **fields) -> TokenChunk:
    """The seq-th chunk of a request: one token, whose text names the request and the token."""
    extra = dict(finish_reason="length", usage=Usage(len(req.prompt_token_ids), seq + 1)) if final else {}
    return TokenChunk(request_id=req.request_id, seq=seq, token_ids=[token], text=f"<{token}>",
                      **extra, **fields)


@pytest.fixture
async def stack(auth_infra, tiny_model_dir):
    """Two gateways, and the wire the test speaks for the scheduler and the engine."""
    gateways = []
    for name in ("gw-a", "gw-b"):
        gateway = GatewayService(GatewayConfig(auth_infra.nats_url, auth_infra.redis_url, [str(tiny_model_dir)],
                                               served_names=[MODEL], port=0, gateway_id=name, require_auth=False,
                                               nats_auth=auth_infra.nats_auth("gateway")))
        await gateway.start()
        gateways.append(gateway)
    wire = await Wire.connect(auth_infra)
    await wire.beat()  # the replica is alive (its limits: not said)
    yield gateways, wire
    await wire.close()
    for gateway in gateways:
        await gateway.stop()


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


async def test_a_batch_with_requests_for_two_gateways_reaches_each_once(stack):
    (gw_a, gw_b), wire = stack
    steps = 3
    async with aiohttp.ClientSession() as http:
        clients = [asyncio.create_task(stream_completion(http, gw.url, "", body([5, 6, 7 + i], steps), timeout=30))
                   for i, gw in enumerate((gw_a, gw_a, gw_b, gw_b))]
        requests = await wire.taken(4)
        by_gateway: dict[str, list[GenerateRequest]] = {}
        for req in requests:
            assert req.batch_to and req.reply_to.startswith(req.batch_to + "."), req
            by_gateway.setdefault(req.batch_to, []).append(req)
        assert sorted(by_gateway) == sorted([gw_a.batch_subject, gw_b.batch_subject])
        assert gw_a.batch_subject != gw_b.batch_subject
        assert all(len(reqs) == 2 for reqs in by_gateway.values())
        token_of = {req.request_id: 100 + 10 * i for i, req in enumerate(requests)}
        for seq in range(steps):
            for batch_to, reqs in by_gateway.items():
                chunks = [chunk(req, seq, token_of[req.request_id] + seq, final=seq == steps - 1) for req in reqs]
                if seq == 1:  # a repeated message delivers nothing twice
                    chunks.append(chunks[0])
                await wire.engine.publish(batch_to, TokenChunkBatch(replica_id=REPLICA, chunks=chunks))
                if seq == 0:  # a batch never reaches another gateway's requests: a chunk of one is dropped
                    other = next(r for b, rs in by_gateway.items() if b != batch_to for r in rs)
                    await wire.engine.publish(batch_to, TokenChunkBatch(replica_id=REPLICA, chunks=[
                        chunk(other, 1, 999)]))
            await wire.engine.nc.flush()
            await asyncio.sleep(0.05)
        outcomes = await asyncio.gather(*clients)
    prompt_of = {tuple(req.prompt_token_ids): req for req in requests}
    for i, outcome in enumerate(outcomes):
        req = prompt_of[(5, 6, 7 + i)]
        first = token_of[req.request_id]
        assert outcome.ok, outcome
        assert outcome.text == "".join(f"<{first + s}>" for s in range(steps)), outcome.text
        assert outcome.usage["completion_tokens"] == steps
        assert outcome.strata["replica_id"] == REPLICA  # the batch's replica, for chunks that do not name one
    assert len(gw_a.flows) == len(gw_b.flows) == 0  # every flow closed


async def test_chunks_alone_and_in_batches_feed_one_stream(stack):
    """A request's chunks may come either way (an error from a scheduler comes alone): the
    stream is the same."""
    (gw_a, _), wire = stack
    async with aiohttp.ClientSession() as http:
        client = asyncio.create_task(stream_completion(http, gw_a.url, "", body([9, 9], 4), timeout=30))
        (req,) = await wire.taken(1)
        for seq in range(4):
            piece = chunk(req, seq, 50 + seq, final=seq == 3, replica_id=REPLICA)
            if seq % 2:
                await wire.engine.publish(req.reply_to, piece)
            else:
                await wire.engine.publish(req.batch_to, TokenChunkBatch(replica_id=REPLICA, chunks=[piece]))
            await wire.engine.nc.flush()
            await asyncio.sleep(0.05)
        outcome = await client
    assert outcome.ok and outcome.text == "<50><51><52><53>", outcome


async def test_a_stream_that_loses_a_chunk_resumes_with_its_original_max_tokens(stack):
    """The next leg asks for the request's own max_tokens, and says how many are done
    (Resume.generated); its chunks, in a batch under the leg's id, continue the client's stream."""
    (gw_a, _), wire = stack
    async with aiohttp.ClientSession() as http:
        client = asyncio.create_task(stream_completion(http, gw_a.url, "", body([3, 4, 5], 6), timeout=30))
        (req,) = await wire.taken(1)
        send = [chunk(req, 0, 60), chunk(req, 1, 61), chunk(req, 3, 63)]  # seq 2 is lost
        for piece in send:
            await wire.engine.publish(req.batch_to, TokenChunkBatch(replica_id=REPLICA, chunks=[piece]))
            await wire.engine.nc.flush()
            await asyncio.sleep(0.05)
        (leg,) = await wire.taken(1, replica="engine-next")
        assert leg.request_id == f"{req.request_id}-m1" and leg.batch_to == req.batch_to
        assert leg.sampling.max_tokens == 6  # the original, not what is left
        assert leg.resume.generated == 2 and leg.resume.request_id == req.request_id
        assert leg.prompt_token_ids == [3, 4, 5, 60, 61] and leg.resume.replica_id == REPLICA
        for seq in range(4):
            await wire.engine.publish(leg.batch_to, TokenChunkBatch(replica_id="engine-next", chunks=[
                chunk(leg, seq, 70 + seq, final=seq == 3)]))
            await wire.engine.nc.flush()
            await asyncio.sleep(0.05)
        outcome = await client
    assert outcome.ok, outcome
    assert outcome.text == "<60><61><70><71><72><73>" and outcome.strata["replica_id"] == "engine-next"


async def test_requests_are_checked_against_the_limits_the_replicas_advertise(stack):
    (gw_a, _), wire = stack
    config_len = gw_a.models[MODEL].max_model_len
    async with aiohttp.ClientSession() as http:
        async def models_max_len() -> int:
            async with http.get(gw_a.url + f"/v1/models/{MODEL}") as resp:
                return (await resp.json())["max_model_len"]

        async def refusal(prompt: list[int], max_tokens: int) -> dict:
            async with http.post(gw_a.url + "/v1/completions", json=body(prompt, max_tokens)) as resp:
                assert resp.status == 400, await resp.text()
                return (await resp.json())["error"]

        assert await models_max_len() == config_len  # no replica said: config.json's
        await wire.beat(max_model_len=64, vocab_size=200)
        deadline = time.monotonic() + 10
        while await models_max_len() != 64:
            assert time.monotonic() < deadline, "the advertised max_model_len never applied"
            await asyncio.sleep(0.05)
        error = await refusal([1] * 10, 60)  # fits config.json's 2048, not the replica's 64
        assert error["code"] == "context_length_exceeded" and "64" in error["message"], error
        error = await refusal([1, 250], 4)  # inside config.json's vocabulary, not the replica's
        assert "250" in error["message"] and "200" in error["message"], error
        # Within the advertised limits: served.
        client = asyncio.create_task(stream_completion(http, gw_a.url, "", body([1] * 10, 54), timeout=30))
        (req,) = await wire.taken(1)
        await wire.engine.publish(req.batch_to, TokenChunkBatch(replica_id=REPLICA, chunks=[
            TokenChunk(request_id=req.request_id, seq=0, token_ids=[1], text="x", finish_reason="stop",
                       usage=Usage(10, 1))]))
        outcome = await client
        assert outcome.ok and outcome.text == "x", outcome
        await wire.beat()  # the replica no longer says (an older engine): config.json's again
        deadline = time.monotonic() + 10
        while await models_max_len() != config_len:
            assert time.monotonic() < deadline, "the fallback to config.json never applied"
            await asyncio.sleep(0.05)


async def test_a_scheduler_refusal_reaches_the_client_as_its_error_not_a_503(stack):
    """A message the scheduler cannot take is answered with an ErrorReply: the client gets its
    code's status and message (a 400 here), not "no scheduler is available"."""
    (gw_a, _), wire = stack
    wire.refusal = "sampling.top_p: must be in (0, 1]"
    async with aiohttp.ClientSession() as http:
        async with http.post(gw_a.url + "/v1/completions", json=body([1, 2], 4)) as resp:
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
    assert error["message"] == wire.refusal and error["code"] == protocol.ErrorCode.BAD_REQUEST
    assert len(gw_a.flows) == 0
