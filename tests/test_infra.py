"""The embedded NATS and Valkey servers, the bus helper and the trace headers it carries."""

import asyncio

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared import protocol
from shared.bus import Bus
from shared.protocol import Cancel, ErrorReply
from shared.store import connect_redis


async def test_msgpack_round_trip_over_nats_carries_the_trace(infra):
    bus = await Bus.connect(infra.nats_url, "test")
    received: asyncio.Queue = asyncio.Queue()

    async def handler(message: Cancel, raw):
        span_context = trace.get_current_span().get_span_context()
        await received.put((message, raw.headers, span_context.trace_id))

    await bus.subscribe("strata.v1.test.roundtrip", Cancel, handler)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("publish") as span:
        await bus.publish("strata.v1.test.roundtrip", Cancel(request_id="req-42", tenant="acme"),
                          headers={protocol.HEADER_REQUEST_ID: "req-42"})
        sent_trace_id = span.get_span_context().trace_id
    message, headers, seen_trace_id = await asyncio.wait_for(received.get(), 5)
    assert message == Cancel(request_id="req-42", tenant="acme")
    assert headers["traceparent"].split("-")[1] == f"{sent_trace_id:032x}"
    assert headers[protocol.HEADER_REQUEST_ID] == "req-42"
    assert seen_trace_id == sent_trace_id  # the handler runs inside the caller's trace
    await bus.close()


async def test_malformed_message_gets_error_reply_and_subscription_keeps_serving(infra):
    bus = await Bus.connect(infra.nats_url, "test")
    handled: list[str] = []

    async def handler(message: Cancel, raw):
        handled.append(message.request_id)
        await raw.respond(b"ok")

    await bus.subscribe("strata.v1.test.bad", Cancel, handler)
    reply = await bus.request("strata.v1.test.bad", b"\xc1garbage", timeout=5)
    error = protocol.decode(ErrorReply, reply.data)
    assert error.error.code == protocol.ErrorCode.BAD_REQUEST
    assert "not valid msgpack" in error.error.message
    reply = await bus.request("strata.v1.test.bad", Cancel(request_id="after"), timeout=5)
    assert reply.data == b"ok" and handled == ["after"]
    await bus.close()


async def test_key_round_trip_through_valkey(infra):
    redis = connect_redis(infra.redis_url)
    await redis.set("strata:test:key", b"value", ex=30)
    assert await redis.get("strata:test:key") == b"value"
    assert (await redis.info("server"))["valkey_version"]  # a real Valkey server answered
    await redis.aclose()
