"""The scheduler: routes generate requests to engine replicas (a queue group: run several).

It is not on the token path: it forwards the request with the caller's reply subject, so the
engine streams straight to the caller. A replica that refuses or does not acknowledge in time is
avoided for a while and the next best one is tried; the caller hears from the scheduler only when
no replica takes the request (one final error chunk).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

from services.scheduler.policy import least_load
from services.scheduler.replicas import ReplicaView
from shared import protocol, registry
from shared.bus import Bus
from shared.logging import get_logger
from shared.protocol import (Cancel, ErrorCode, ErrorInfo, GenerateAck, GenerateRequest, Heartbeat, TokenChunk)
from shared.store import connect_redis

log = get_logger()


@dataclass
class SchedulerConfig:
    nats_url: str
    redis_url: str
    scheduler_id: str = "scheduler"
    ack_timeout: float = 2.0
    max_attempts: int = 3
    registry_sync_interval: float = 1.0
    lease_ttl: float = 5.0


class SchedulerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.decisions = Counter("strata:scheduler_decisions", "Routing decisions.", ["policy", "outcome"],
                                 registry=self.registry)
        self.retries = Counter("strata:scheduler_retries", "Requests re-sent to another replica.",
                               registry=self.registry)
        self.routing_time = Histogram("strata:scheduler_routing_seconds", "Receipt to engine acknowledgement.",
                                      registry=self.registry)


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.view = ReplicaView(stale_after=cfg.lease_ttl)
        self.rng = random.Random()
        self.metrics = SchedulerMetrics()
        self.bus: Bus | None = None
        self.redis = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        structlog.contextvars.bind_contextvars(scheduler_id=self.cfg.scheduler_id)
        self.bus = await Bus.connect(self.cfg.nats_url, f"scheduler-{self.cfg.scheduler_id}")
        self.redis = connect_redis(self.cfg.redis_url, f"scheduler-{self.cfg.scheduler_id}")
        await self.bus.subscribe(protocol.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await self.bus.subscribe(protocol.GENERATE, GenerateRequest, self.on_generate,
                                 queue=protocol.SCHEDULER_QUEUE, concurrent=True)
        await self.bus.subscribe(protocol.CANCEL, Cancel, self.on_cancel)
        self._spawn(self._registry_loop())
        log.info("scheduler ready")

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.bus.close()
        await self.redis.aclose()

    async def on_heartbeat(self, hb: Heartbeat, _raw) -> None:
        self.view.on_heartbeat(hb)

    async def on_cancel(self, _msg: Cancel, _raw) -> None:
        """Nothing is held here yet (no admission queue): engines act on cancels themselves."""

    async def sync_registry(self) -> None:
        for model in set(self.view.models()) | set(await registry.models(self.redis)):
            self.view.sync_registry(model, await registry.live_replicas(self.redis, model))

    async def _registry_loop(self) -> None:
        while True:
            try:
                await self.sync_registry()
            except Exception as exc:  # Redis away: keep routing on heartbeats alone
                log.warning("registry sync failed", error=str(exc))
            await asyncio.sleep(self.cfg.registry_sync_interval)

    async def on_generate(self, req: GenerateRequest, raw) -> None:
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        received = time.time()
        if raw.reply:  # receipt: the caller now knows a scheduler owns the request
            await self.bus.publish(raw.reply, GenerateAck(req.request_id, "", True))
        req.timestamps["scheduler_received"] = received
        tried: set[str] = set()
        for attempt in range(self.cfg.max_attempts):
            candidates = [r for r in self.view.candidates(req.model) if r.replica_id not in tried]
            if not candidates:
                break
            choice = least_load(candidates, self.rng)[0]
            tried.add(choice.replica_id)
            choice.inflight += 1
            req.timestamps["scheduler_routed"] = time.time()
            ack = await self._forward(req, choice.replica_id)
            if ack is not None and ack.accepted:
                self.metrics.decisions.labels("least_load", "routed").inc()
                self.metrics.routing_time.observe(time.time() - received)
                return
            choice.inflight -= 1
            if ack is not None and ack.error is not None and ack.error.code == ErrorCode.BAD_REQUEST:
                await self._fail(req, ack.error.code, ack.error.message)  # another replica would say the same
                return
            self.view.avoid(choice.replica_id)
            self.metrics.retries.inc()
            log.info("replica refused or timed out; trying another", replica_id=choice.replica_id,
                     error=None if ack is None or ack.error is None else ack.error.message)
        self.metrics.decisions.labels("least_load", "no_replica").inc()
        if not self.view.replicas.get(req.model) and not tried:
            await self._fail(req, ErrorCode.OVERLOADED, f"no replica of model {req.model!r} is running")
        else:
            await self._fail(req, ErrorCode.OVERLOADED, f"no replica of model {req.model!r} can take the request")

    async def _forward(self, req: GenerateRequest, replica_id: str) -> GenerateAck | None:
        try:
            reply = await self.bus.request(protocol.engine_generate(replica_id), req, timeout=self.cfg.ack_timeout)
            return protocol.decode(GenerateAck, reply.data)
        except Exception as exc:  # timeout, no responders, garbage: treat as a refusal
            log.warning("forward failed", replica_id=replica_id, error=f"{exc.__class__.__name__}: {exc}")
            return None

    async def _fail(self, req: GenerateRequest, code: str, message: str) -> None:
        await self.bus.publish(req.reply_to, TokenChunk(request_id=req.request_id, seq=0, finish_reason="error",
                                                        error=ErrorInfo(code=code, message=message)))
