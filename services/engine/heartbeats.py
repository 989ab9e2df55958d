"""Heartbeats and the registry lease from a thread of their own.

A replica's liveness must not depend on how busy it is: under overload the worker's event loop
has thousands of messages to get through and a step may take long, and a heartbeat that waits
behind either makes a busy replica look dead (then its streams migrate, re-running prompts at
the worst moment). So this thread has its own event loop, its own NATS and Redis connections,
and reads the figures it reports without waiting on anything: the engine's counters as they are
now, and the latency figures the worker last computed. It stops only with the process, so a
frozen process (SIGSTOP) or a dead one still falls silent; a stalled engine shows as heartbeats
whose `steps_total` no longer advances while the replica holds work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from shared import protocol, registry
from shared.bus import Bus, NatsAuth
from shared.logging import get_logger
from shared.protocol import Heartbeat
from shared.store import connect_redis

log = get_logger()


class HeartbeatThread:
    """Every `interval` seconds: publish `make()` (a Heartbeat) and refresh the registry entry
    with it plus `extra()` fields, until stop()."""

    def __init__(self, name: str, nats_url: str, nats_auth: NatsAuth, redis_url: str, interval: float,
                 lease_ttl: float, make: Callable[[], Heartbeat], extra: Callable[[], dict]):
        self.name, self.nats_url, self.nats_auth, self.redis_url = name, nats_url, nats_auth, redis_url
        self.interval, self.lease_ttl = interval, lease_ttl
        self.make, self.extra = make, extra
        self.beats = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        self._started.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        bus = redis = None
        try:
            bus = await Bus.connect(self.nats_url, f"{self.name}-heartbeat", auth=self.nats_auth)
            redis = connect_redis(self.redis_url, f"{self.name}-heartbeat")
        except Exception as exc:  # the worker's own connections failed the same way; it reports that
            log.error("heartbeat connections failed", error=str(exc))
        self._started.set()
        try:
            while bus is not None and not self._stop.is_set():
                await self.beat(bus, redis)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            if bus is not None:
                await bus.close()
            if redis is not None:
                await redis.aclose()

    async def beat(self, bus: Bus, redis) -> None:
        try:
            hb = self.make()
            await bus.publish(protocol.heartbeat(hb.replica_id), hb)
            fields = hb.to_dict() | self.extra()
            await registry.refresh(redis, hb.replica_id, hb.model, fields, self.lease_ttl)
            self.beats += 1
        except Exception as exc:  # NATS or Redis away: keep trying, the lease tells the truth
            log.warning("heartbeat failed", error=f"{exc.__class__.__name__}: {exc}")
