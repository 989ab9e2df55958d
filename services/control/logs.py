"""`strata logs`: follow the services' log lines live off NATS, filtered by service and request.

Lines come from `strata.v1.logs.<service>.<instance>` (shared.logstream). With `since`, the
follow starts that far back, replayed from the STRATA_LOGS JetStream stream, then goes on live.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from shared import protocol
from shared.logstream import STREAM_MAX_AGE_S as RETENTION_S  # how far back JetStream keeps lines
from shared.protocol import LogLine

# The id a client sees is the response's `id` (`chatcmpl-<id>`, `cmpl-<id>`) or the
# `x-request-id` header (`<id>`); the services log `<id>`.
RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")


def request_id(given: str) -> str:
    """The request id the services log, from a response id or an x-request-id."""
    given = given.strip()
    for prefix in RESPONSE_ID_PREFIXES:
        if given.startswith(prefix):
            return given[len(prefix):]
    return given


def matches(line: LogLine, service: str | None, request_id: str | None) -> bool:
    if service and line.service != service:
        return False
    return not request_id or line.fields.get("request_id") == request_id


def render(line: LogLine, as_json: bool) -> str:
    if as_json:
        return json.dumps({"service": line.service, "instance": line.instance, "level": line.level,
                           "event": line.event, "timestamp": line.timestamp, **line.fields}, ensure_ascii=False)
    extra = " ".join(f"{k}={v}" for k, v in line.fields.items()
                     if k not in ("service", "gateway_id", "scheduler_id", "replica_id"))
    return f"{line.timestamp} {line.service}/{line.instance} {line.level:7s} {line.event} {extra}".rstrip()


async def follow(nats_url: str, emit: Callable[[LogLine], None], stop: asyncio.Event, service: str | None = None,
                 request_id: str | None = None, since: float = 0.0, live: bool = True) -> None:
    """Call emit(line) for every matching line until `stop` is set. since > 0: start that many
    seconds back (needs JetStream on the server). live=False: only what was logged (from
    `since` back to now), then return."""
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy

    subject = protocol.logs(service, "*") if service else protocol.LOGS_ALL
    nc = await nats.connect(servers=[nats_url], name="strata-logs", connect_timeout=5, allow_reconnect=live)

    def on_data(data: bytes) -> None:
        try:
            line = protocol.decode(LogLine, data)
        except protocol.ProtocolError:
            return
        if matches(line, service, request_id):
            emit(line)

    async def on_message(msg) -> None:
        on_data(msg.data)

    start = datetime.now(timezone.utc) - timedelta(seconds=since)
    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
    try:
        if not live:
            await _replay(nc.jetstream(), subject, config, on_data, stop)
            return
        if since > 0:
            await nc.jetstream().subscribe(subject, cb=on_message, ordered_consumer=True, config=config)
        else:
            await nc.subscribe(subject, cb=on_message)
        await stop.wait()
    finally:
        await nc.close()


async def _replay(js, subject: str, config, on_data: Callable[[bytes], None], stop: asyncio.Event) -> None:
    """Every stored line from the consumer's start to what the stream holds now: an ephemeral
    pull consumer, fetched until nothing is pending."""
    from nats.errors import TimeoutError as NatsTimeoutError

    sub = await js.pull_subscribe(subject, config=config)
    try:
        if (await sub.consumer_info()).num_pending == 0:
            return
        while not stop.is_set():
            try:
                batch = await sub.fetch(512, timeout=2.0)
            except NatsTimeoutError:
                return
            for msg in batch:
                on_data(msg.data)
            if batch and batch[-1].metadata.num_pending == 0:
                return
    finally:
        await sub.unsubscribe()
