"""The worker's outbox without a bus: grouping a step's chunks by destination (pure), steps as
event-loop turns, and a stream's one final message. Publishing is recorded, not sent; the
payloads are decoded as a receiver would."""

import asyncio

from services.engine.chunk_sink import ChunkSink, StreamContext
from services.engine.metrics import EngineMetrics
from services.engine.outbox import Outbox, Outgoing, group_step
from services.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from shared import protocol
from shared.protocol import ErrorCode, GenerateAck, GenerateRequest, TokenChunk, TokenChunkBatch


def chunk(rid: str, seq: int = 0, **kw) -> TokenChunk:
    return TokenChunk(request_id=rid, seq=seq, token_ids=[seq + 10], **kw)


def test_a_steps_chunks_group_by_gateway_and_the_rest_stay_as_they_are():
    ack = GenerateAck("r5", "e1", False)
    step = [Outgoing("gw.a", chunk("r1"), batched=True), Outgoing("in.r4", chunk("r4")),
            Outgoing("gw.b", chunk("r3"), batched=True), Outgoing("in.r5.accepted", ack),
            Outgoing("gw.a", chunk("r2"), batched=True), Outgoing("gw.a", chunk("r5", finish_reason="error",
                                                                                  error=protocol.ErrorInfo("x", "y")),
                                                                batched=True)]
    out = group_step(step, "e1")
    assert [subject for subject, _ in out] == ["in.r4", "gw.b", "in.r5.accepted", "gw.a"]
    by_subject = dict(out)
    assert [c.request_id for c in by_subject["gw.a"].chunks] == ["r1", "r2", "r5"]
    assert [c.request_id for c in by_subject["gw.b"].chunks] == ["r3"]
    assert all(isinstance(by_subject[s], TokenChunkBatch) and by_subject[s].replica_id == "e1"
               for s in ("gw.a", "gw.b"))
    # The ack of r5 goes out before r5's final chunk (its batch is placed where its last chunk was).
    assert out.index(("in.r5.accepted", ack)) < [s for s, _ in out].index("gw.a")
    assert group_step([], "e1") == []


def request(rid: str, batch_to: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="tiny", reply_to=f"_INBOX.t.{rid}", prompt="x", batch_to=batch_to)


async def test_each_event_loop_turn_is_one_step_and_one_encode_per_batch():
    sent: list[tuple[str, bytes]] = []

    async def recorded(subject, payload):
        sent.append((subject, payload))

    outbox = Outbox(recorded, "e1")
    publisher = asyncio.create_task(outbox.run())
    a, b, plain = request("a", "_INBOX.gw.a"), request("b", "_INBOX.gw.a"), request("p")
    try:
        for seq in range(2):  # two steps, each delivered in one turn
            for r in (a, b, plain):
                outbox.send_chunk(r, chunk(r.request_id, seq))
            for _ in range(5):
                await asyncio.sleep(0)
        await outbox.flush()
    finally:
        publisher.cancel()
    assert [s for s, _ in sent] == ["_INBOX.gw.a", "_INBOX.t.p"] * 2  # the batch where its last chunk came
    steps = [protocol.decode(TokenChunkBatch, p) for s, p in sent if s == "_INBOX.gw.a"]
    assert [[(c.request_id, c.seq) for c in batch.chunks] for batch in steps] == [[("a", 0), ("b", 0)],
                                                                               [("a", 1), ("b", 1)]]
    assert [protocol.decode(TokenChunk, p).seq for s, p in sent if s == "_INBOX.t.p"] == [0, 1]


def output(rid: str, finished: bool, metrics: RequestMetrics | None) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "", [5], "length" if finished else None)],
                         finished, new_token_ids=[5], metrics=metrics)


async def test_a_stream_that_fails_in_the_worker_ends_once():
    """A bad output makes the sink fail: the request is aborted and ends in one error; the
    abort's own last output, coming after, sends nothing more."""
    sent: list[tuple[str, bytes]] = []

    async def recorded(subject, payload):
        sent.append((subject, payload))

    aborted, ended = [], []
    outbox = Outbox(recorded, "e1")
    ctx = StreamContext("e1", 0, EngineMetrics("tiny", "e1"), outbox, abort=aborted.append, on_end=ended.append)
    sink = ChunkSink(ctx, request("r", "_INBOX.gw.a"), arrival=0.0)
    sink.deliver(output("r", True, metrics=None))  # a finished output without metrics: building its chunk fails
    sink.deliver(output("r", True, metrics=RequestMetrics(arrival_time=0.0)))
    await outbox.flush()
    assert aborted == ["r"] and ended == [sink]
    chunks = [c for _, p in sent for c in protocol.decode(TokenChunkBatch, p).chunks]
    assert len(chunks) == 1 and chunks[0].is_final and chunks[0].error.code == ErrorCode.INTERNAL
