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
from shared.protocol import LogLine


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
                 request_id: str | None = None, since: float = 0.0, auth=None) -> None:
    """Call emit(line) for every matching line until `stop` is set. since > 0: start that many
    seconds back (needs JetStream on the server)."""
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy

    subject = protocol.logs(service, "*") if service else protocol.LOGS_ALL
    from shared.bus import NatsAuth, servers

    nc = await nats.connect(servers=servers(nats_url), name="strata-logs", connect_timeout=5,
                            **(auth or NatsAuth()).connect_options())

    async def on_message(msg) -> None:
        try:
            line = protocol.decode(LogLine, msg.data)
        except protocol.ProtocolError:
            return
        if matches(line, service, request_id):
            emit(line)

    try:
        if since > 0:
            start = datetime.now(timezone.utc) - timedelta(seconds=since)
            await nc.jetstream().subscribe(subject, cb=on_message, ordered_consumer=True, config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start))
        else:
            await nc.subscribe(subject, cb=on_message)
        await stop.wait()
    finally:
        await nc.close()

