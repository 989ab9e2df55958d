"""The scheduler: routes generate requests to engine replicas (a queue group: run several).

It is not on the token path: it forwards the request with the caller's reply subject, so the
engine streams straight to the caller. Routing is by policy (kv_aware by default: the prefix
index in Redis, fed by the engines' KV events, tells how much of the prompt each replica holds).
When every replica is saturated, or none is ready yet (starting, scaled to zero), requests wait
in a bounded admission queue (priority classes, fair across tenants) for as long as they can
still be served by their deadline and within the queue's wait budget; past that they are
refused at once with `overloaded` and when to retry. A replica that refuses or does not
acknowledge is avoided for a while and the next is tried; a forward that timed out is withdrawn
from that replica only (its cancel names the replica), so it cannot refuse the retry. The caller
hears from the scheduler only when nobody takes the request.
Requests for a LoRA adapter hash their prompt on the adapter's chain (their KV is the
adapter's own) and weigh where the adapter is resident and where placement packs it
(services.scheduler.lora_placement, recomputed every second from recent demand).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog
from aiohttp import web
from nats.errors import NoRespondersError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.admission import AdmissionQueue, QueuedRequest
from services.scheduler.lora_placement import DemandWindow, place_adapters, placed_replicas
from services.scheduler.policy import POLICIES, Router, prefix_overlaps
from services.scheduler.prefix_index import RESYNC_LOCK_TTL_S, PrefixIndex
from services.scheduler.regions import DEFAULT_PENALTY_S, rank_across_regions
from services.scheduler.replicas import ReplicaView
from services.scheduler.tracing import RoutingSpans
from shared import http, keys, protocol, registry
from shared.deployments import DeploymentWatcher
from shared.block_hash import adapter_root_hash, prompt_block_hashes
from shared.bus import Bus, NatsAuth
from shared.logging import get_logger
from shared.metrics_history import MetricsHistory, metrics_response
from shared.protocol import (Cancel, ErrorCode, ErrorInfo, GenerateAck, GenerateRequest, Heartbeat, KvEventBatch,
                             KvSnapshot, KvSnapshotRequest, SchedulerStats, TokenChunk)
from shared.store import connect_redis

log = get_logger()


@dataclass
class SchedulerConfig:
    nats_url: str
    redis_url: str
    scheduler_id: str = "scheduler"
    policy: str = "kv_aware"  # default for deployments that do not choose
    policies: dict[str, str] = field(default_factory=dict)  # deployment -> policy
    load_weight: float = 4.0  # kv_aware: blocks of prefill one request of load is worth
    ack_timeout: float = 2.0
    max_attempts: int = 3
    max_queue: int = 1024
    max_queue_wait: float = 30.0  # seconds a request may wait in the admission queue
    no_replica_wait: float = 10.0  # a model with no deployment and no replica heard of: wait this long for one
    registry_sync_interval: float = 1.0
    http_host: str = "127.0.0.1"
    http_port: int = 0  # /metrics and /health (0: any free port)
    lease_ttl: float = 5.0
    seed: int | None = None
    region: str = ""  # this scheduler's region: requests that name none are from here
    inter_region_penalty_s: float = DEFAULT_PENALTY_S  # cross only when the queueing avoided is worth more
    nats_auth: NatsAuth = field(default_factory=NatsAuth)


def away_from_the_lost_replica(req: GenerateRequest, candidates: list) -> list:
    """A resumed request (protocol.Resume) does not go back to the replica its stream left, which
    is presumed dead, unless no other is there (then it may be alive after all)."""
    left = req.resume.replica_id if req.resume is not None else None
    others = [r for r in candidates if r.replica_id != left]
    return others or candidates


class SchedulerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("strata:scheduler_decisions", "Routing decisions.",
                                 ["model_name", "policy", "outcome", "revision"], registry=r)
        self.matched = Histogram("strata:scheduler_matched_prefix_fraction",
                                 "Fraction of the prompt's blocks cached on the chosen replica.", ["model_name"],
                                 buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.reachable = Histogram("strata:scheduler_reachable_prefix_fraction",
                                   "Fraction of the prompt's blocks cached on the replica holding the most of it "
                                   "(what routing could reach, whatever the policy).",
                                   ["model_name"], buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.retries = Counter("strata:scheduler_retries", "Requests re-sent to another replica.", registry=r)
        self.routing_time = Histogram("strata:scheduler_routing_seconds", "Receipt to engine acknowledgement.",
                                      registry=r)
        self.queue_depth = Gauge("strata:scheduler_queue_depth", "Requests in the admission queue.", ["model_name"],
                                 registry=r)
        self.queue_wait = Histogram("strata:scheduler_queue_wait_seconds", "Time spent in the admission queue.",
                                    ["model_name"], registry=r)
        self.index_events = Counter("strata:scheduler_kv_event_batches", "KV event batches by outcome.",
                                    ["outcome"], registry=r)
        self.cross_region = Counter("strata:scheduler_cross_region", "Requests routed out of their region.",
                                    ["model_name", "from_region", "to_region"], registry=r)
        self.refused = Counter("strata:scheduler_refused_requests",
                               "Requests refused with overloaded, by reason (queue_full, cannot_start_in_time, "
                               "no_replica).", ["model_name", "reason"], registry=r)


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig):
        for name in [cfg.policy, *cfg.policies.values()]:
            if name not in POLICIES:
                raise ValueError(f"unknown routing policy {name!r} (one of {', '.join(POLICIES)})")
        self.cfg = cfg
        self.view = ReplicaView(stale_after=cfg.lease_ttl)
        self.router = Router(cfg.load_weight, cfg.seed)
        self.metrics = SchedulerMetrics()
        self.history = MetricsHistory(self.metrics.registry)
        self.queues: dict[str, AdmissionQueue] = {}
        self.bus: Bus | None = None
        self.redis = None
        self.index: PrefixIndex | None = None
        self._tasks: set[asyncio.Task] = set()
        self._resyncing: dict[tuple[str, str], list[KvEventBatch]] = {}  # batches that arrived meanwhile
        self._runner: web.AppRunner | None = None
        self.http_url = ""
        self.deployments: DeploymentWatcher | None = None
        self._wake_dispatch = asyncio.Event()
        self._dispatched: dict[str, int] = {}  # model -> dispatched from its queue this second
        self._cancelled: dict[str, float] = {}  # request id -> when a cancel arrived while routing
        self._routing: dict[str, str | None] = {}  # request id -> tenant, while waiting for an engine
        self.spans = RoutingSpans()
        self.lora_demand: dict[str, DemandWindow] = {}  # model -> recent requests per adapter
        self.lora_placed: dict[str, dict[str, set[str]]] = {}  # model -> adapter -> replicas packed with it

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        structlog.contextvars.bind_contextvars(scheduler_id=self.cfg.scheduler_id)
        self.bus = await Bus.connect(self.cfg.nats_url, f"scheduler-{self.cfg.scheduler_id}", auth=self.cfg.nats_auth)
        self.redis = connect_redis(self.cfg.redis_url, f"scheduler-{self.cfg.scheduler_id}")
        self.index = PrefixIndex(self.redis)
        self.deployments = DeploymentWatcher(self.redis, self._on_deployment_change)
        await self.deployments.start(self.bus)
        await self.bus.subscribe(protocol.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await self.bus.subscribe(protocol.KV_EVENTS_ALL, KvEventBatch, self.on_kv_events)
        await self.bus.subscribe(protocol.GENERATE, GenerateRequest, self.on_generate,
                                 queue=protocol.SCHEDULER_QUEUE, concurrent=True)
        await self.bus.subscribe(protocol.CANCEL, Cancel, self.on_cancel)
        try:
            await self.sync_registry(deep=True)
        except Exception as exc:
            log.warning("initial registry sync failed", error=str(exc))
        self._spawn(self._registry_loop())
        self._spawn(self._dispatch_loop())
        self._spawn(self._stats_loop())
        await self._start_http()
        self._spawn(self.history.run())
        self._spawn(registry.keep_announced(self.redis, "scheduler", self.cfg.scheduler_id, {"http_url": self.http_url},
                                            ttl=self.cfg.lease_ttl))
        log.info("scheduler ready", policy=self.cfg.policy, http=self.http_url)

    async def _start_http(self) -> None:
        async def metrics(request: web.Request) -> web.Response:
            return metrics_response(request, self.metrics.registry, self.history)

        async def health(_request: web.Request) -> web.Response:
            connected = self.bus.nc.is_connected
            return web.json_response({"scheduler_id": self.cfg.scheduler_id, "nats": connected},
                                     status=200 if connected else 503)

        self._runner, self.http_url = await http.serve({"/metrics": metrics, "/health": health},
                                                       self.cfg.http_host, self.cfg.http_port)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        self.deployments.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        for model, queue in self.queues.items():  # what we held ends with an error, not silence
            while (item := queue.pop()) is not None:
                await self._fail(item.payload, ErrorCode.UNAVAILABLE, "scheduler shutting down")
        await self.bus.close()
        await self.redis.aclose()

    def policy_for(self, model: str) -> str:
        deployment = self.deployments.deployments.get(model)
        return self.cfg.policies.get(model) or (deployment.state.routing_policy if deployment else self.cfg.policy)

    async def _on_deployment_change(self, name: str, deployment) -> None:
        if deployment is None and self.queues.get(name):  # deleted: what waited for it ends now
            queue = self.queues.pop(name)
            while (item := queue.pop()) is not None:
                await self._fail(item.payload, ErrorCode.NOT_FOUND, f"deployment {name!r} was deleted")
        self._wake_dispatch.set()

    def revision_candidates(self, model: str, candidates: list, draw: float) -> tuple[list, int]:
        """The replicas of the revision this request goes to (by the deployment's canary
        weight), or, while that revision has none ready, those of the others it serves."""
        deployment = self.deployments.deployments.get(model)
        if deployment is None:
            return candidates, 0
        revision = deployment.state.revision_for(draw)
        chosen = [r for r in candidates if r.revision == revision]
        if chosen:
            return chosen, revision
        serving = deployment.state.serving()
        return [r for r in candidates if r.revision in serving] or candidates, revision

    # ---- replicas and the prefix index ------------------------------------------------------
    async def on_heartbeat(self, hb: Heartbeat, _raw) -> None:
        self.view.on_heartbeat(hb)
        if self.queues.get(hb.model):
            self._wake_dispatch.set()

    async def on_kv_events(self, batch: KvEventBatch, _raw) -> None:
        key = (batch.model, batch.replica_id)
        if key in self._resyncing:  # applied after the snapshot, in order, instead of being lost
            self._resyncing[key].append(batch)
            self.metrics.index_events.labels("buffered").inc()
            return
        outcome = await self._apply(batch)
        if outcome == "gap":
            self._spawn(self.resync(batch.model, batch.replica_id))

    async def _apply(self, batch: KvEventBatch) -> str:
        stored = [s.block_hash for s in batch.stored]
        if batch.cleared:  # a (re)started engine: its cache began empty
            await self.index.replace(batch.model, batch.replica_id, batch.epoch, batch.seq,
                                     set(stored) - set(batch.removed))
            outcome = "cleared"
        else:
            outcome = await self.index.apply(batch.model, batch.replica_id, batch.epoch, batch.seq, stored,
                                             batch.removed)
        self.metrics.index_events.labels(outcome).inc()
        return outcome

    async def resync(self, model: str, replica_id: str) -> None:
        """Rebuild one replica's index entries from its snapshot (one scheduler at a time), then
        apply the batches that arrived meanwhile."""
        key = (model, replica_id)
        if key in self._resyncing or not await self.index.try_lock_resync(model, replica_id):
            return
        self._resyncing[key] = []
        gap = False
        try:
            reply = await self.bus.request(protocol.engine_kv_snapshot(replica_id), KvSnapshotRequest(replica_id),
                                           timeout=RESYNC_LOCK_TTL_S)
            snap = protocol.decode(KvSnapshot, reply.data)
            await self.index.replace(model, replica_id, snap.epoch, snap.seq, snap.block_hashes)
            log.info("prefix index resynced", replica_id=replica_id, blocks=len(snap.block_hashes), seq=snap.seq)
            while self._resyncing[key]:  # more may arrive while these are applied
                pending, self._resyncing[key] = self._resyncing[key], []
                for batch in sorted(pending, key=lambda b: b.seq):
                    gap = gap or await self._apply(batch) == "gap"
        except Exception as exc:
            log.warning("prefix index resync failed", replica_id=replica_id, error=f"{exc.__class__.__name__}: {exc}")
        finally:
            self._resyncing.pop(key, None)
            await self.index.unlock_resync(model, replica_id)
        if gap:  # a batch was lost for good during the resync: once more
            self._spawn(self.resync(model, replica_id))

    async def sync_registry(self, deep: bool = False) -> None:
        models = set(self.view.models()) | set(await registry.models(self.redis))
        for model in models:
            live, dead = await registry.sweep(self.redis, model)
            self.view.sync_registry(model, live)
            for replica_id in await self.index.unindexed(model, list(live)):
                self._spawn(self.resync(model, replica_id))
            for replica_id in dead:
                await self.index.remove_replica(model, replica_id)
            if deep:  # index entries of replicas gone before anyone swept them: a keyspace scan
                async for key in self.redis.scan_iter(match=keys.replica_blocks(model, "*"), count=1000):
                    replica_id = key.decode().rsplit(":", 1)[1]
                    if replica_id not in live:
                        await self.index.remove_replica(model, replica_id)

    async def _registry_loop(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self.cfg.registry_sync_interval)
            rounds += 1
            try:
                await self.sync_registry(deep=rounds % 30 == 0)
            except Exception as exc:  # Redis away: keep routing on heartbeats alone
                log.warning("registry sync failed", error=str(exc))

    # ---- requests ---------------------------------------------------------------------------
    async def on_generate(self, req: GenerateRequest, raw) -> None:
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        req.timestamps["scheduler_received"] = time.time()
        self.spans.begin(req)
        if raw.reply:  # receipt: the caller now knows a scheduler owns the request
            await self.bus.publish(raw.reply, GenerateAck(req.request_id, self.cfg.scheduler_id, True))
        if req.lora is not None:
            self.lora_demand.setdefault(req.model, DemandWindow()).add(req.lora, time.monotonic())
        # No replica ready (starting, scaled to zero, or none heard of yet): the request waits in
        # the queue, whose depth tells the scaler to start one, within its deadline.
        if req.deadline is not None and req.deadline <= time.time():
            await self._fail(req, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the request was routed")
            return
        candidates = self.view.candidates(req.model)
        queue = self.queues.get(req.model)
        if candidates and not (queue and len(queue)) and not all(r.saturated for r in candidates):
            await self.route(req)
            return
        await self.enqueue(req)

    def known(self, model: str) -> bool:
        """A model something serves or will: a deployment, or a replica heard of in any state."""
        return bool(self.view.replicas.get(model)) or model in self.deployments.deployments

    def start_by(self, req: GenerateRequest, now: float) -> float:
        """When the request must have left the queue for its first token to come before its
        deadline (as long as the model's replicas take to one now), and at the latest after the
        queue's wait budget. (max_tokens says only how long it may run, not how long it will.)"""
        start_by = now + self.cfg.max_queue_wait
        if req.deadline is not None:
            start_by = min(start_by, req.deadline - self.view.time_to_first_token(req.model))
        return start_by

    async def enqueue(self, req: GenerateRequest) -> None:
        queue = self.queues.setdefault(req.model, AdmissionQueue(self.cfg.max_queue))
        now = time.time()
        start_by = self.start_by(req, now)
        wait = queue.estimated_wait(req.priority)
        if wait is not None and now + wait > start_by:  # it would only wait to be refused: refuse it now
            self.metrics.refused.labels(req.model, "cannot_start_in_time").inc()
            await self._fail(req, ErrorCode.OVERLOADED, f"all replicas are busy: the request would wait {wait:.1f}s, "
                             f"more than it can", retry_after=queue.retry_after())
            return
        refused = queue.push(QueuedRequest(req.request_id, req.tenant or "", req.priority or "standard",
                                           time.monotonic(), start_by, req))
        self.metrics.queue_depth.labels(req.model).set(len(queue))
        if refused is not None:
            self.metrics.refused.labels(req.model, "queue_full").inc()
            await self._fail(refused.payload, ErrorCode.OVERLOADED, "all replicas are saturated and the queue is full",
                             retry_after=queue.retry_after())
        self._wake_dispatch.set()

    async def _dispatch_loop(self) -> None:
        """Move queued requests to replicas as room appears (heartbeats wake it; a timer too)."""
        last = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(self._wake_dispatch.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
            self._wake_dispatch.clear()
            try:
                await self._dispatch_once()
            except Exception:  # never let the loop die: queued requests depend on it
                log.exception("dispatch failed")
            now = time.monotonic()
            if now - last >= 1.0:
                for model, queue in list(self.queues.items()):
                    queue.note_dispatch_rate(self._dispatched.pop(model, 0), now - last)
                last = now

    async def _dispatch_once(self) -> None:
        now_wall, now = time.time(), time.monotonic()
        for model, queue in list(self.queues.items()):  # route() awaits: the dict may grow meanwhile
            for item in queue.expired(now_wall):
                self.metrics.refused.labels(model, "cannot_start_in_time").inc()
                await self._fail(item.payload, ErrorCode.OVERLOADED, "the request cannot start before its deadline: "
                                 "all replicas are saturated", retry_after=queue.retry_after())
            if not self.known(model):  # nothing serves it, nor is starting to: not forever
                for item in [i for i in queue.index.values() if now - i.enqueued_at >= self.cfg.no_replica_wait]:
                    queue.remove(item.request_id)
                    self.metrics.refused.labels(model, "no_replica").inc()
                    await self._fail(item.payload, ErrorCode.OVERLOADED, f"no replica of model {model!r} is running "
                                     f"or starting (waited {self.cfg.no_replica_wait:g}s)")
            while len(queue):
                candidates = self.view.candidates(model)
                if not candidates or all(r.saturated for r in candidates):
                    break
                item = queue.pop()
                item.payload.timestamps["scheduler_dequeued"] = time.time()
                self.spans.dequeued(item.payload)
                self.metrics.queue_wait.labels(model).observe(time.monotonic() - item.enqueued_at)
                self._dispatched[model] = self._dispatched.get(model, 0) + 1
                await self.route(item.payload)
            self.metrics.queue_depth.labels(model).set(len(queue))

    async def route(self, req: GenerateRequest) -> None:
        """Send req to the best replica that takes it; every outcome ends in one final message
        to the caller: the engine's stream, or an error from here."""
        self._routing[req.request_id] = req.tenant
        try:
            await self._route(req)
        except Exception as exc:
            log.exception("routing failed")
            await self._fail(req, ErrorCode.INTERNAL, f"routing failed: {exc.__class__.__name__}")
        finally:
            self.spans.end(req.request_id)
            self._routing.pop(req.request_id, None)
            if self._cancelled.pop(req.request_id, None) is not None:  # cancelled while in transit
                await self.bus.publish(protocol.CANCEL, Cancel(request_id=req.request_id, tenant=req.tenant))

    async def _route(self, req: GenerateRequest) -> None:
        received = req.timestamps.get("scheduler_received", time.time())
        policy = self.policy_for(req.model)
        draw = self.router.rng.random()  # once per request: retries stay on its revision
        tried: set[str] = set()
        revision = 0
        for attempt in range(1, self.cfg.max_attempts + 1):
            if req.request_id in self._cancelled:
                await self.bus.publish(req.reply_to, TokenChunk(request_id=req.request_id, seq=0, finish_reason="abort"))
                return
            candidates = away_from_the_lost_replica(req, [r for r in self.view.candidates(req.model)
                                                          if r.replica_id not in tried])
            if not candidates:
                break
            candidates, revision = self.revision_candidates(req.model, candidates, draw)
            block_size = candidates[0].block_size
            hashes = prompt_block_hashes(req.prompt_token_ids or [], block_size, adapter_root_hash(req.lora))
            overlaps = {}
            # Every policy looks the prompt up (one Redis round trip), so the reachable prefix
            # fraction is known whichever routes: it is how diagnose tells a wrong policy.
            if hashes and len(candidates) > 1:  # one candidate: nothing to weigh
                try:
                    holders = await self.index.holders(req.model, hashes)
                    overlaps = prefix_overlaps(holders, [r.replica_id for r in candidates])
                except Exception as exc:  # Redis away: route on load alone
                    log.warning("prefix index unavailable", error=str(exc))
            region = req.region or self.cfg.region
            choice_of_region = rank_across_regions(self.router, policy, candidates, region,
                                                   self.cfg.inter_region_penalty_s, len(hashes), overlaps, req.lora,
                                                   self.lora_placed.get(req.model, {}).get(req.lora))
            ranked = choice_of_region.ranked
            decision = ranked[0]
            self.spans.decided(req, ranked, attempt, revision)
            choice = decision.replica
            tried.add(choice.replica_id)
            choice.inflight += 1
            req.timestamps["scheduler_routed"] = time.time()
            ack, maybe_taken = await self._forward(req, choice.replica_id)
            choice.inflight -= 1
            if ack is not None and ack.accepted:
                choice.acknowledged(ack.accepted_seq)
                self.metrics.decisions.labels(req.model, policy, "routed", str(revision)).inc()
                if choice_of_region.crossed:
                    self.metrics.cross_region.labels(req.model, region, choice.region).inc()
                if overlaps:  # what was looked up: the chosen replica's share against the best one's
                    self.metrics.matched.labels(req.model).observe(decision.cached_blocks / len(hashes))
                    self.metrics.reachable.labels(req.model).observe(max(overlaps.values()) / len(hashes))
                log.info("routed", request_id=req.request_id, replica_id=choice.replica_id, policy=policy,
                         lora=req.lora, region=choice.region or None, crossed=choice_of_region.reason or None,
                         revision=revision, attempt=attempt, cached_blocks=decision.cached_blocks, prompt_blocks=len(hashes),
                         queue_wait_ms=round((req.timestamps.get("scheduler_dequeued", received) - received) * 1e3, 3))
                self.metrics.routing_time.observe(time.time() - received)
                return
            if ack is None and maybe_taken:
                # No answer in time: the engine may still have taken it. Withdraw it there, and only
                # there (the cancel names the replica), before trying elsewhere, so the request never
                # runs twice into one stream and the retry is not refused as cancelled.
                await self.bus.publish(protocol.CANCEL, Cancel(request_id=req.request_id, tenant=req.tenant,
                                                               replica_id=choice.replica_id))
            elif ack is not None and ack.error is not None and not self._retryable(req, ack.error.code):
                await self._fail(req, ack.error.code, ack.error.message)  # about the request: final
                return
            self.view.avoid(choice.replica_id)
            self.metrics.retries.inc()
            log.info("replica refused or timed out; trying another", replica_id=choice.replica_id,
                     error=None if ack is None or ack.error is None else ack.error.message)
        self.metrics.decisions.labels(req.model, policy, "no_replica", str(revision)).inc()
        await self._fail(req, ErrorCode.OVERLOADED, f"no replica of model {req.model!r} can take the request")

    def _retryable(self, req: GenerateRequest, code: str) -> bool:
        """A refusal another replica may not repeat: it is about this replica, not the request. An
        engine's `cancelled` the caller did not ask for (a cancel meant for another replica's run)
        is one of them: only a client that left ends its own request."""
        return code in (ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED) or (
            code == ErrorCode.CANCELLED and req.request_id not in self._cancelled)

    async def _forward(self, req: GenerateRequest, replica_id: str) -> tuple[GenerateAck | None, bool]:
        """The replica's answer, or None and whether it may have taken the request anyway (no
        answer in time) or cannot have (nobody listens on its subject: a replica that is gone, or
        one a forged heartbeat made up)."""
        req.accept_by = time.time() + self.cfg.ack_timeout  # a replica that gets it later must not take it
        try:
            with self.spans.active(req.request_id):  # the engine's spans join this request's trace here
                reply = await self.bus.request(protocol.engine_generate(replica_id), req, timeout=self.cfg.ack_timeout)
            return protocol.decode(GenerateAck, reply.data), False
        except NoRespondersError:
            log.warning("forward failed: nobody serves the replica's subject", replica_id=replica_id)
            return None, False
        except Exception as exc:  # timeout, garbage: treat as a refusal that may have been taken
            log.warning("forward failed", replica_id=replica_id, error=f"{exc.__class__.__name__}: {exc}")
            return None, True

    async def _fail(self, req: GenerateRequest, code: str, message: str, retry_after: float | None = None) -> None:
        self.spans.end(req.request_id, code, message)
        await self.bus.publish(req.reply_to, TokenChunk(request_id=req.request_id, seq=0, finish_reason="error",
                                                        error=ErrorInfo(code=code, message=message,
                                                                        retry_after_s=retry_after)))

    async def on_cancel(self, msg: Cancel, _raw) -> None:
        """A request still in our admission queue ends here; one being routed is cancelled at
        its engine once the engine has it; engines handle the rest. A cancel naming a replica
        withdraws one forward from that replica: it is not the caller's."""
        if msg.replica_id is not None:
            return
        if msg.request_id in self._routing and msg.tenant == self._routing[msg.request_id]:
            self._cancelled[msg.request_id] = time.monotonic()
            return
        for queue in self.queues.values():
            item = queue.index.get(msg.request_id)
            if item is None:
                continue
            if item.tenant and msg.tenant != item.tenant:
                return
            queue.remove(msg.request_id)
            self.spans.end(msg.request_id, ErrorCode.CANCELLED)
            await self.bus.publish(item.payload.reply_to, TokenChunk(request_id=msg.request_id, seq=0,
                                                                     finish_reason="abort"))
            return

    def place_adapters(self, now: float) -> None:
        """Re-pack each model's adapters onto its replicas from the recent demand."""
        for model, window in self.lora_demand.items():
            replicas = [r for r in self.view.candidates(model) if r.max_loras]
            placement = place_adapters(window.demand(now), {r.replica_id: r.max_loras for r in replicas},
                                       {r.replica_id: set(r.lora_resident) for r in replicas})
            self.lora_placed[model] = placed_replicas(placement)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            self.place_adapters(now)
            stats = SchedulerStats(scheduler_id=self.cfg.scheduler_id,
                                   queue_depth={m: len(q) for m, q in self.queues.items()},
                                   oldest_wait_s={m: q.oldest_wait(now) for m, q in self.queues.items()},
                                   timestamp=time.time(), http_url=self.http_url)
            try:
                await self.bus.publish(protocol.scheduler_stats(self.cfg.scheduler_id), stats)
            except Exception as exc:
                log.warning("stats publish failed", error=str(exc))
