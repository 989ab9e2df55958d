"""The scaler: every tick, each deployment's signals go through its policy, placement splits
the replica counts across the capacity pools, and each pool's actuator makes them true.

Signals come from the bus: engine heartbeats (state, running, waiting, KV usage, recent TTFT)
and the schedulers' queue stats. Bounds, SLOs and the canary split come from the deployment
(control), picked up live, and so do the pools (services.scaler.pools). The desired count is
split across the revisions being served by the canary weight (a canary with any weight gets at
least one replica), then each revision's count across the pools the deployment allows
(services.scaler.placement); revisions no longer served are scaled to zero, which drains them.
A deployment the store lost (not deleted: no tombstone) is held as it was: an emptied store
drains nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from services.scaler.actuators import Actuator
from services.scaler.placement import Placer
from services.scaler.policy import ScalerPolicy, ScalingConfig, Signals
from services.scaler.pools import PoolSet
from services.scheduler.lora_placement import adapter_replica_floor
from shared import http, protocol, registry
from shared.bus import Bus, NatsAuth
from shared.deployments import Deployment, DeploymentWatcher
from shared.logging import get_logger
from shared.pools import PoolSpec, PoolWatcher
from shared.protocol import Heartbeat, PoolStatus, ScalerDecision, SchedulerStats
from shared.store import connect_redis

log = get_logger()


@dataclass
class ScalerConfig:
    nats_url: str
    redis_url: str
    scaler_id: str = "scaler"
    interval: float = 1.0
    stale_after: float = 5.0  # a heartbeat or scheduler report older than this is ignored
    http_host: str = "127.0.0.1"
    http_port: int = 0
    region: str = ""  # the region of the scaler's own actuator (the pool `default`)
    pool_backoff_s: float = 30.0  # a refusing pool's first back-off; doubles with each refusal in a row
    pool_max_backoff_s: float = 600.0
    nats_auth: NatsAuth = field(default_factory=NatsAuth)


def policy_config(deployment: Deployment, cold_start_s: float) -> ScalingConfig:
    spec = deployment.stable_spec
    return ScalingConfig(min_replicas=spec.replicas.min, max_replicas=spec.replicas.max,
                         target_concurrency=spec.scaling.target_concurrency, ttft_slo_s=spec.slo.ttft_ms / 1000,
                         stable_window_s=spec.scaling.stable_window_s, panic_window_s=spec.scaling.panic_window_s,
                         scale_down_delay_s=spec.scaling.scale_down_delay_s,
                         scale_to_zero_after_s=spec.scaling.scale_to_zero_after_s, cold_start_s=cold_start_s)


def lora_floor(live: list[Heartbeat]) -> int:
    """The replicas the LoRA adapters in use (running or waiting anywhere) need to be resident
    at once, at the fewest slots a replica has (services.scheduler.lora_placement)."""
    slots = [hb.max_loras for hb in live if hb.max_loras]
    in_use = {a for hb in live for a in (*hb.lora_running, *hb.lora_waiting)}
    return adapter_replica_floor(in_use, min(slots)) if slots else 0


def split_by_revision(desired: int, serving: dict[int, int]) -> dict[int, int]:
    """Replicas per revision for a traffic split (revision -> percent). A revision with any
    traffic gets at least one replica while the deployment has any."""
    if desired <= 0 or not serving:
        return dict.fromkeys(serving, 0)
    counts = {rev: max(1, math.floor(desired * pct / 100 + 0.5)) if pct else 0 for rev, pct in serving.items()}
    stable = max(serving, key=lambda rev: serving[rev])
    others = sum(n for rev, n in counts.items() if rev != stable)
    counts[stable] = max(1, desired - others)
    return counts


class ScalerService:
    def __init__(self, cfg: ScalerConfig, actuator: Actuator,
                 make_actuator: Callable[[PoolSpec], Actuator] | None = None):
        """`actuator` is the scaler's own place (the pool `default` while control stores no
        pool); `make_actuator` builds one for each pool control stores."""
        self.cfg = cfg
        self.pools = PoolSet(actuator, make_actuator, cfg.region, Placer(cfg.pool_backoff_s, cfg.pool_max_backoff_s))
        self.bus: Bus | None = None
        self.redis = None
        self.deployments: DeploymentWatcher | None = None
        self.pool_watcher: PoolWatcher | None = None
        self.policies: dict[str, ScalerPolicy] = {}
        self.next_cold_start_s: dict[str, float] = {}  # deployment -> cold start of the pool its next replica goes to
        self.short: dict[str, int] = {}  # deployment -> wanted replicas no allowed pool can take
        self.wanted: dict[str, int] = {}
        self.replicas: dict[str, tuple[float, Heartbeat]] = {}
        self.queues: dict[str, tuple[float, SchedulerStats]] = {}
        self.last: dict[str, ScalerDecision] = {}
        self.registry = r = CollectorRegistry()
        self.m_desired = Gauge("strata:scaler_desired_replicas", "Replicas the policy wants.",
                               ["deployment", "revision"], registry=r)
        self.m_ready = Gauge("strata:scaler_ready_replicas", "Replicas ready.", ["deployment"], registry=r)
        self.m_panic = Gauge("strata:scaler_panic", "1 while the policy is in panic mode.", ["deployment"],
                             registry=r)
        self.m_changes = Counter("strata:scaler_scale_events", "Changes of the desired count.",
                                 ["deployment", "direction"], registry=r)
        self.m_pools = PoolMetrics(r)
        self.m_lost = Gauge("strata:scaler_deployments_missing_from_store",
                            "Deployments the store lost (not deleted): the scaler holds them as they were.", registry=r)
        self._task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.http_url = ""

    async def start(self) -> None:
        structlog.contextvars.bind_contextvars(scaler_id=self.cfg.scaler_id)
        self.bus = await Bus.connect(self.cfg.nats_url, f"scaler-{self.cfg.scaler_id}", auth=self.cfg.nats_auth)
        self.redis = connect_redis(self.cfg.redis_url, f"scaler-{self.cfg.scaler_id}")
        self.deployments = DeploymentWatcher(self.redis)
        self.m_lost.set_function(lambda: len(self.deployments.lost))
        await self.deployments.start(self.bus)
        self.pool_watcher = PoolWatcher(self.redis, on_change=self.pools.sync)
        await self.pool_watcher.start(self.bus)
        await self.bus.subscribe(protocol.HEARTBEAT_ALL, Heartbeat, self._on_heartbeat)
        await self.bus.subscribe(protocol.SCHEDULER_STATS_ALL, SchedulerStats, self._on_scheduler_stats)
        self._task = asyncio.create_task(self._loop())
        await self._start_http()
        self._announcer = asyncio.create_task(registry.keep_announced(self.redis, "scaler", self.cfg.scaler_id,
                                                                      {"http_url": self.http_url}))
        log.info("scaler ready", actuator=type(self.pools.pools["default"].actuator).__name__, http=self.http_url,
                 pools=sorted(self.pools.pools))

    async def _start_http(self) -> None:
        async def metrics(_request):
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def health(_request):
            ok = self.bus.nc.is_connected and self._task is not None and not self._task.done()
            return web.json_response({"scaler_id": self.cfg.scaler_id, "ok": ok}, status=200 if ok else 503)

        self._runner, self.http_url = await http.serve({"/metrics": metrics, "/health": health},
                                                       self.cfg.http_host, self.cfg.http_port)

    async def stop(self) -> None:
        self._task.cancel()
        self._announcer.cancel()
        self.deployments.stop()
        self.pool_watcher.stop()
        await self.pools.close()  # local engines drain before the scaler goes
        if self._runner is not None:
            await self._runner.cleanup()
        await self.bus.close()
        await self.redis.aclose()

    async def _on_heartbeat(self, hb: Heartbeat, _raw) -> None:
        first_ready = hb.state == "ready" and (
            hb.replica_id not in self.replicas or self.replicas[hb.replica_id][1].state != "ready")
        self.replicas[hb.replica_id] = (time.monotonic(), hb)
        if first_ready:
            found = self.pools.note_ready(hb.replica_id)
            if found is not None:
                log.info("replica ready", replica_id=hb.replica_id, pool=found[0], cold_start_s=round(found[1], 2))

    async def _on_scheduler_stats(self, stats: SchedulerStats, _raw) -> None:
        self.queues[stats.scheduler_id] = (time.monotonic(), stats)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop scaling
                log.exception("scaler tick failed")
            await asyncio.sleep(self.cfg.interval)

    def signals(self, name: str, now: float) -> tuple[Signals, list[Heartbeat]]:
        live = [hb for seen, hb in self.replicas.values()
                if hb.deployment == name and now - seen <= self.cfg.stale_after]
        ready = [hb for hb in live if hb.state == "ready"]
        fresh = [stats for seen, stats in self.queues.values() if now - seen <= self.cfg.stale_after]
        ttfts = [hb.ttft_p90_s for hb in ready if hb.ttft_p90_s is not None]
        return Signals(
            now=now, ready=len(ready), starting=0, running=sum(hb.running for hb in ready),
            waiting=sum(hb.waiting for hb in ready), queue_depth=sum(s.queue_depth.get(name, 0) for s in fresh),
            oldest_wait_s=max((s.oldest_wait_s.get(name, 0.0) for s in fresh), default=0.0),
            kv_usage=(sum(hb.kv_blocks_used / max(hb.kv_blocks_total, 1) for hb in ready) / len(ready)
                      if ready else 0.0),
            ttft_p90_s=max(ttfts) if ttfts else None), live

    async def tick(self) -> None:
        now = time.monotonic()
        names = sorted(set(self.deployments.deployments) | set(self.policies))
        await self.pools.observe(names, now)
        for name in list(self.policies):
            if name not in self.deployments.deployments:  # deleted: its replicas drain away
                del self.policies[name]
                self.short.pop(name, None)
                self.wanted.pop(name, None)
                await self.pools.scale_to_zero(name)
        for name, deployment in list(self.deployments.deployments.items()):
            try:
                await self._scale_deployment(name, deployment, now)
            except Exception:  # one deployment's trouble must not stop the others scaling
                log.exception("scaling failed", deployment=name)
        await self._report_pools(names, now)
        await self.pools.retire_empty()

    async def _report_pools(self, deployments: list[str], now: float) -> None:
        reports = self.pools.reports(deployments, now)
        self.m_pools.update(reports, self.short, self.wanted)
        await self.bus.publish(protocol.SCALER_POOLS, PoolStatus(
            scaler_id=self.cfg.scaler_id, timestamp=time.time(), pools=reports,
            short={d: n for d, n in self.short.items() if n}, wanted=dict(self.wanted)))

    async def _scale_deployment(self, name: str, deployment: Deployment, now: float) -> None:
        # The trend term sizes for a cold start ahead: that of the pool the next replicas go to.
        config = policy_config(deployment, self.next_cold_start_s.get(name, 10.0))
        policy = self.policies.get(name)
        if policy is None:
            policy = self.policies[name] = ScalerPolicy(config)
        else:
            policy.update_config(config)
        signals, live = self.signals(name, now)
        serving = deployment.state.serving()
        revisions = set(serving) | self.pools.revisions(name)
        ready_by_rev = {rev: sum(hb.state == "ready" and hb.revision == rev for hb in live) for rev in revisions}
        signals.starting = sum(h.starting for rev in revisions for h in self.pools.held(name, rev).values())
        decision = policy.decide(signals)
        floor = lora_floor(live)
        if floor > decision.desired and decision.desired < config.max_replicas:
            decision.desired = min(floor, config.max_replicas)
            decision.reason += f"; LoRA adapters in use need {floor} replicas"
        counts = split_by_revision(decision.desired, serving)
        for rev in self.pools.revisions(name) - set(counts):
            counts[rev] = 0  # no longer served: drain
        loads = {hb.replica_id: hb.running + hb.waiting for hb in live}
        prefs = deployment.stable_spec.placement
        short = 0
        for rev, n in sorted(counts.items()):
            spec = deployment.specs.get(rev)
            if spec is None and n:
                continue
            plan = await self.pools.place(name, rev, spec, n, spec.placement if spec else prefs, loads, now)
            short += plan.short
            if rev == deployment.state.stable and plan.next_cold_start_s is not None:
                self.next_cold_start_s[name] = plan.next_cold_start_s
            self.m_desired.labels(name, str(rev)).set(n)
            held = self.pools.held(name, rev)
            msg = ScalerDecision(deployment=name, revision=rev, desired=n, ready=ready_by_rev.get(rev, 0),
                                 starting=sum(h.starting for h in held.values()),
                                 reason=decision.reason, panic=decision.panic, timestamp=time.time(),
                                 pools={p: t for p, t in plan.targets.items() if t}, short=plan.short,
                                 placement=plan.describe())
            previous = self.last.get(f"{name}/{rev}")
            if previous is None or previous.desired != n:
                direction = "up" if previous is None or n > previous.desired else "down"
                self.m_changes.labels(name, direction).inc()
                log.info("scale", deployment=name, revision=rev, desired=n, ready=msg.ready, starting=msg.starting,
                         reason=decision.reason, panic=decision.panic, queue=signals.queue_depth,
                         running=signals.running, placement=msg.placement)
            self.last[f"{name}/{rev}"] = msg
            await self.bus.publish(protocol.SCALER_STATUS, msg)
        self.m_ready.labels(name).set(signals.ready)
        self.m_panic.labels(name).set(int(decision.panic))
        self.short[name], self.wanted[name] = short, decision.desired
        if short:
            log.warning("capacity short", deployment=name, wanted=decision.desired, short=short,
                        reason="every allowed pool is full or refusing")


class PoolMetrics:
    """strata:pool_* gauges and counters, from each tick's pool reports."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.capacity = Gauge("strata:pool_capacity_replicas", "Replicas the pool may hold (its spec).", ["pool"],
                              registry=r)
        self.effective = Gauge("strata:pool_effective_capacity_replicas",
                               "Replicas placement may put in the pool now (less while it is backed off).", ["pool"],
                               registry=r)
        self.used = Gauge("strata:pool_used_replicas", "Replicas alive in the pool (ready, starting, draining).",
                          ["pool"], registry=r)
        self.ready = Gauge("strata:pool_ready_replicas", "Replicas ready in the pool.", ["pool"], registry=r)
        self.cost = Gauge("strata:pool_cost_per_hour", "What the replicas alive in the pool cost per hour.", ["pool"],
                          registry=r)
        self.cold_start = Gauge("strata:pool_cold_start_seconds", "The pool's cold start (measured, moving average).",
                                ["pool"], registry=r)
        self.backoff = Gauge("strata:pool_backoff_seconds", "Seconds left of the pool's back-off after a refusal.",
                             ["pool"], registry=r)
        self.refusals = Counter("strata:pool_refusals", "Times the pool refused or could not place replicas.",
                                ["pool"], registry=r)
        self.replicas = Gauge("strata:pool_deployment_replicas", "A deployment's replicas in the pool.",
                              ["pool", "deployment"], registry=r)
        self.short = Gauge("strata:pool_short_replicas",
                           "Replicas a deployment wants that no allowed pool can take (all full or refusing).",
                           ["deployment"], registry=r)
        self.wanted = Gauge("strata:pool_wanted_replicas", "Replicas the scaler wants for a deployment.",
                            ["deployment"], registry=r)
        self._refusals: dict[str, int] = {}
        self._pools: set[str] = set()

    def update(self, reports: list, short: dict[str, int], wanted: dict[str, int]) -> None:
        # Series of retired pools and of deployments gone from a pool go away, not stay at their last value.
        names = {p.name for p in reports}
        for gone in self._pools - names:
            for gauge in (self.capacity, self.effective, self.used, self.ready, self.cost, self.cold_start,
                          self.backoff):
                gauge.remove(gone)
        self._pools = names
        for gauge in (self.replicas, self.short, self.wanted):
            gauge.clear()
        for p in reports:
            self.capacity.labels(p.name).set(p.capacity)
            self.effective.labels(p.name).set(p.effective_capacity)
            self.used.labels(p.name).set(p.used)
            self.ready.labels(p.name).set(p.ready)
            self.cost.labels(p.name).set(p.used * p.cost_per_hour)
            self.cold_start.labels(p.name).set(p.cold_start_s)
            self.backoff.labels(p.name).set(p.backoff_s)
            self.refusals.labels(p.name).inc(p.refusals - self._refusals.get(p.name, 0))
            self._refusals[p.name] = p.refusals
            for d, n in p.deployments.items():
                self.replicas.labels(p.name, d).set(n)
        for d, n in wanted.items():
            self.wanted.labels(d).set(n)
            self.short.labels(d).set(short.get(d, 0))
