"""Another team's service, written only from docs/protocol.md: plain nats-py and msgpack.

Nothing from the project is imported here; the fixture only tells us where NATS listens.
"""

import asyncio
import uuid

import msgpack
import nats


async def test_submit_on_generate_and_read_the_whole_stream(stack):
    nc = await nats.connect(stack.infra.nats_url)
    inbox = f"_INBOX.{uuid.uuid4().hex}"
    chunks, done = [], asyncio.Event()

    async def on_chunk(msg):
        chunk = msgpack.unpackb(msg.data)
        chunks.append(chunk)
        if chunk.get("finish_reason") or chunk.get("error"):
            done.set()

    await nc.subscribe(inbox, cb=on_chunk)
    request = {"v": 1, "request_id": uuid.uuid4().hex, "model": "tiny-llama", "reply_to": inbox,
               "prompt": "Hello from another team", "sampling": {"max_tokens": 20, "temperature": 0,
                                                                 "ignore_eos": True}}
    await nc.publish("strata.v1.generate", msgpack.packb(request))
    await asyncio.wait_for(done.wait(), 30)
    await nc.close()
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    final = chunks[-1]
    assert final["finish_reason"] == "length" and "error" not in final
    assert sum(len(c["token_ids"]) for c in chunks) == 20 == final["usage"]["completion_tokens"]
    assert isinstance("".join(c["text"] for c in chunks), str)
