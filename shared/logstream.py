"""Every service's structured log lines, also on NATS, so `strata logs` can follow them live.

`TAP` is a structlog processor (installed by shared.logging, inert until started): it copies each
emitted event into a bounded queue and never blocks or raises. A publisher task on its own NATS
connection (log floods never share a socket with token streams) drains the queue every
`interval` seconds to `strata.v1.logs.<service>.<instance>`. When the queue is full, new lines
are dropped and counted; a failed publish is counted, never logged (a log line about logging
would feed the queue it failed to drain). JetStream, where the server has it, keeps the lines
for a while (the STRATA_LOGS stream), so `strata logs --since 5m` can replay them.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from datetime import datetime, timezone

from shared import protocol
from shared.protocol import LogLine

MAX_PENDING = 10_000  # lines waiting for the publisher; beyond this they are dropped
STREAM_MAX_AGE_S = 3600.0
STREAM_MAX_BYTES = 256 * 1024 * 1024
STREAM_REPLICAS = 3  # on a NATS cluster; a single server keeps one copy
_TOP_LEVEL = ("service", "level", "event", "timestamp")


def subject_token(name: str) -> str:
    """An id as a subject token (host names have dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name) or "_"


def _plain(value):
    """A msgpack-safe copy: primitives as they are, containers walked, anything else as text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    return str(value)


def to_line(event: dict, service: str, instance: str) -> LogLine:
    fields = {k: _plain(v) for k, v in event.items() if k not in _TOP_LEVEL}
    return LogLine(service=service, instance=instance, level=str(event.get("level", "info")),
                   event=str(event.get("event", "")), timestamp=str(event.get("timestamp", "")), fields=fields)


class LogTap:
    """The structlog processor. Thread-safe: the engine logs from its step thread too."""

    def __init__(self, max_pending: int = MAX_PENDING):
        self.max_pending = max_pending
        self.pending: deque[dict] = deque()
        self.enabled = False
        self.dropped = 0

    def __call__(self, _logger, _method, event_dict: dict) -> dict:
        if self.enabled:
            if len(self.pending) < self.max_pending:
                self.pending.append(dict(event_dict))
            else:
                self.dropped += 1
        return event_dict


TAP = LogTap()


class LogPublisher:
    """Drains a tap to NATS until closed."""

    def __init__(self, nc, service: str, instance: str, tap: LogTap = TAP, interval: float = 0.1):
        self.nc, self.tap, self.interval = nc, tap, interval
        self.service, self.instance = service, subject_token(instance)
        self.subject = protocol.logs(service, self.instance)
        self.failed = 0
        self._reported_drops = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.tap.enabled = True
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.drain()

    async def drain(self) -> None:
        pending = self.tap.pending
        while pending:
            await self._publish(pending.popleft())
        dropped = self.tap.dropped
        if dropped > self._reported_drops:  # said on the stream itself, not through the tap
            await self._publish({"event": "log lines dropped", "level": "warning",
                                 "timestamp": datetime.now(timezone.utc).isoformat(),
                                 "dropped": dropped - self._reported_drops, "dropped_total": dropped})
            self._reported_drops = dropped

    async def _publish(self, event: dict) -> None:
        try:
            await self.nc.publish(self.subject, protocol.encode(to_line(event, self.service, self.instance)))
        except Exception:  # NATS away, buffer full, an odd value: count it, never log it
            self.failed += 1

    async def close(self) -> None:
        """Publish what is queued, then close the connection."""
        self.tap.enabled = False
        if self._task is not None:
            self._task.cancel()
        try:
            await asyncio.wait_for(self.drain(), 2)
            await asyncio.wait_for(self.nc.drain(), 2)
        except Exception:
            await self.nc.close()


async def ensure_stream(nc) -> bool:
    """The JetStream stream keeping recent log lines, replicated on three servers where the
    cluster has them (else on one); False where the server has no JetStream."""
    from nats.js.api import DiscardPolicy, StorageType, StreamConfig

    for replicas in (STREAM_REPLICAS, 1):
        config = StreamConfig(name=protocol.LOGS_STREAM, subjects=[protocol.LOGS_ALL], max_age=STREAM_MAX_AGE_S,
                              max_bytes=STREAM_MAX_BYTES, storage=StorageType.FILE, discard=DiscardPolicy.OLD,
                              num_replicas=replicas)
        try:
            await nc.jetstream(timeout=2).add_stream(config)
            return True
        except Exception:  # fewer servers, no JetStream, or configured otherwise by an operator: live only
            continue
    return False


async def start(nats_url: str, service: str, instance: str, auth=None) -> LogPublisher | None:
    """Publish this process's log lines (None if NATS cannot be reached: the service still runs,
    its lines only go to stderr)."""
    import nats

    from shared.bus import NatsAuth, servers

    async def ignore(*_args) -> None:  # connection trouble must not log through the tap
        return None

    try:
        nc = await nats.connect(servers=servers(nats_url), name=f"logs-{service}-{instance}", connect_timeout=5,
                                allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                error_cb=ignore, disconnected_cb=ignore, reconnected_cb=ignore, closed_cb=ignore,
                                **(auth or NatsAuth()).connect_options())
    except Exception:
        return None
    await ensure_stream(nc)
    publisher = LogPublisher(nc, service, instance)
    publisher.start()
    return publisher
