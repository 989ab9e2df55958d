"""The scaler's capacity pools: one actuator per pool (one Kubernetes client per cluster, or
engine processes on this machine with a capacity limit), built from the pools control stores
and rebuilt when they change; each tick, every deployment's replicas are placed across them by
the placement policy (services.scaler.placement) and the actuators make it so.

While control stores no pool, the actuator the scaler was started with (`--actuator`) is the
one pool, `default`, without limit: a single-place fleet works as before. A pool that is
deleted, and `default` once control has pools, is retired: it gets no capacity, so its
replicas move to the others make-before-break, and its actuator closes once it holds none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from services.scaler.actuators import Actuator, PoolRefused
from services.scaler.placement import Held, Placer, Plan, PoolView
from shared.deployments import DeploymentSpec, Placement
from shared.logging import get_logger
from shared.pools import DEFAULT_POOL, UNLIMITED, PoolSpec
from shared.protocol import PoolReport

log = get_logger()


@dataclass
class Pool:
    spec: PoolSpec
    actuator: Actuator
    cold_start_s: float  # measured (moving average), the spec's estimate until measured
    measured: bool = False
    retiring: bool = False  # deleted (or `default` once control has pools): no capacity, closed when empty

    def view(self) -> PoolView:
        s = self.spec
        return PoolView(s.name, s.region, 0 if self.retiring else s.capacity, s.cost_per_hour, self.cold_start_s,
                        s.labels)

    def note_cold_start(self, seconds: float) -> None:
        self.cold_start_s = seconds if not self.measured else 0.7 * self.cold_start_s + 0.3 * seconds
        self.measured = True


class PoolSet:
    def __init__(self, default: Actuator, make_actuator: Callable[[PoolSpec], Actuator] | None = None,
                 region: str = "", placer: Placer | None = None, default_cold_start_s: float = 10.0):
        self.make_actuator = make_actuator
        self.placer = placer or Placer()
        spec = PoolSpec(DEFAULT_POOL, region=region, capacity=UNLIMITED, cost_per_hour=0.0,
                        cold_start_s=default_cold_start_s)
        self.pools: dict[str, Pool] = {DEFAULT_POOL: Pool(spec, default, default_cold_start_s)}
        self._default = default

    # ---- pools from control -----------------------------------------------------------------
    async def sync(self, specs: dict[str, PoolSpec]) -> None:
        """Control's pools changed: new ones get an actuator, changed ones their new figures (and
        a new client when the cluster's settings changed), removed ones retire."""
        if self.make_actuator is None and specs:
            log.warning("pools are stored in control, but this scaler was started without pool actuators")
            return
        for name, spec in specs.items():
            pool = self.pools.get(name)
            if pool is None or pool.spec.actuator.kind != spec.actuator.kind:
                if pool is not None:  # another kind of place under the same name: the old one retires
                    pool.retiring = True
                    self.pools[f"{name}~{pool.spec.generation}"] = self.pools.pop(name)
                self.pools[name] = Pool(spec, self.make_actuator(spec), spec.cold_start_s)
                self.pools[name].actuator.set_capacity(spec.capacity)
                log.info("pool added", pool=name, kind=spec.actuator.kind, capacity=spec.capacity, region=spec.region)
                continue
            if pool.spec.actuator != spec.actuator:  # the same kind, new cluster settings: a new client
                await pool.actuator.close()
                pool.actuator = self.make_actuator(spec)
            if not pool.measured:
                pool.cold_start_s = spec.cold_start_s
            pool.actuator.set_capacity(spec.capacity)
            if spec.capacity != pool.spec.capacity:
                log.info("pool capacity changed", pool=name, capacity=spec.capacity, was=pool.spec.capacity)
            pool.spec, pool.retiring = spec, False
        for name, pool in self.pools.items():
            if name not in specs and not pool.retiring and (name != DEFAULT_POOL or specs):
                pool.retiring = True
                log.info("pool retiring", pool=name)
        if not specs and DEFAULT_POOL in self.pools:
            self.pools[DEFAULT_POOL].retiring = False

    async def retire_empty(self) -> None:
        for name, pool in list(self.pools.items()):
            if pool.retiring and pool.actuator.alive() == 0 and pool.actuator is not self._default:
                await pool.actuator.close()
                del self.pools[name]
                log.info("pool retired", pool=name)

    # ---- each tick --------------------------------------------------------------------------
    async def observe(self, deployments: list[str], now: float) -> None:
        for name, pool in self.pools.items():
            await pool.actuator.observe(deployments)
            for seconds in pool.actuator.take_cold_starts():
                pool.note_cold_start(seconds)
            self.placer.observe(name, sum(pool.actuator.held(d, r).ready for d in deployments
                                                    for r in pool.actuator.revisions(d)), now)

    def held(self, deployment: str, revision: int) -> dict[str, Held]:
        return {name: pool.actuator.held(deployment, revision) for name, pool in self.pools.items()}

    def revisions(self, deployment: str) -> set[int]:
        return {rev for pool in self.pools.values() for rev in pool.actuator.revisions(deployment)}

    def note_ready(self, replica_id: str) -> tuple[str, float] | None:
        """A replica's first ready heartbeat: (its pool, its cold start) when a local pool started it."""
        for name, pool in self.pools.items():
            cold = pool.actuator.note_ready(replica_id)
            if cold is not None:
                return name, cold
        return None

    async def place(self, deployment: str, revision: int, spec: DeploymentSpec | None, wanted: int,
                    prefs: Placement, loads: dict[str, int], now: float) -> Plan:
        """Place `wanted` replicas of one revision and have the actuators act on it. A pool that
        refuses is backed off and the count is placed again at once: the next pool takes the
        rest in this same tick."""
        for _ in range(len(self.pools) + 1):
            held = self.held(deployment, revision)
            others = {name: max(pool.actuator.alive() - held[name].active - held[name].draining, 0)
                      for name, pool in self.pools.items()}
            views = [p.view() for p in self.pools.values() if not p.retiring]  # retiring: its replicas move away
            plan = self.placer.place(wanted, views, held, others, prefs, now)
            refused = False
            for name, target in plan.steps(held):
                if not target and not held[name].active:
                    continue
                try:
                    await self.pools[name].actuator.scale(deployment, revision, spec, target, loads)
                except PoolRefused as exc:
                    if target <= held[name].ready:  # giving replicas back failed: no capacity lost, try next tick
                        log.warning("pool did not scale down", pool=name, deployment=deployment, reason=exc.reason)
                        continue
                    backoff = self.placer.refused(name, now, exc.held, exc.reason)
                    log.warning("pool refused", pool=name, deployment=deployment, revision=revision,
                                reason=exc.reason, held=exc.held, backoff_s=backoff)
                    refused = True
                    break
            if not refused:
                return plan
        return plan

    async def scale_to_zero(self, deployment: str) -> None:
        """A deleted deployment: every pool's replicas of it drain."""
        for pool in self.pools.values():
            for rev in pool.actuator.revisions(deployment):
                await pool.actuator.scale(deployment, rev, None, 0, {})

    def reports(self, deployments: list[str], now: float) -> list[PoolReport]:
        out = []
        for name, pool in sorted(self.pools.items()):
            if pool.retiring and not pool.actuator.alive():
                continue  # `default` once control has pools, and nothing left in it
            per = {d: sum(pool.actuator.held(d, r).active for r in pool.actuator.revisions(d)) for d in deployments}
            helds = [pool.actuator.held(d, r) for d in deployments for r in pool.actuator.revisions(d)]
            view = pool.view()
            out.append(PoolReport(
                name=name, region=pool.spec.region, kind=pool.spec.actuator.kind if name != DEFAULT_POOL else "",
                capacity=view.capacity, effective_capacity=self.placer.capacity(view, now), used=pool.actuator.alive(),
                ready=sum(h.ready for h in helds), starting=sum(h.starting for h in helds),
                draining=sum(h.draining for h in helds), cost_per_hour=pool.spec.cost_per_hour,
                cold_start_s=pool.cold_start_s, cold_start_measured=pool.measured,
                refusals=self.placer.refusals(name), backoff_s=self.placer.backoff_left(name, now),
                last_refusal=self.placer.last_refusal(name), deployments={d: n for d, n in per.items() if n}))
        return out

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.actuator.close()
