"""Deployments as every service reads them: the spec of a revision and the live state that
says which revisions serve how much traffic. Written only by control (services.control.store);
read by the gateway (names, aliases, tokenizer), schedulers (revision split, routing policy) and
the scaler (bounds, SLOs). `DeploymentWatcher` keeps a service's copy current: control's
announcement on CONTROL_DEPLOYMENTS triggers a re-read, and a periodic resync heals a lost one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import redis.asyncio as aioredis

from shared import keys, protocol
from shared.logging import get_logger

log = get_logger()


@dataclass
class Replicas:
    min: int = 1
    max: int = 4


@dataclass
class Slo:
    ttft_ms: float = 2000.0
    itl_ms: float = 200.0


@dataclass
class Scaling:
    target_concurrency: float = 16.0
    scale_down_delay_s: float = 30.0
    scale_to_zero_after_s: float = 120.0
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0


@dataclass
class DeploymentSpec:
    name: str
    model: str
    aliases: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    replicas: Replicas = field(default_factory=Replicas)
    slo: Slo = field(default_factory=Slo)
    routing: dict[str, str] = field(default_factory=lambda: {"policy": "kv_aware"})
    canary: dict[str, Any] = field(default_factory=lambda: {"weight": 0})  # weight, and analysis
    scaling: Scaling = field(default_factory=Scaling)
    # LoRA adapters [{name, path}]: live state, applied to running replicas (shared.adapters);
    # a change of adapters alone makes no new revision.
    adapters: list[dict[str, str]] = field(default_factory=list)

    @property
    def routing_policy(self) -> str:
        return self.routing.get("policy", "kv_aware")

    @property
    def canary_weight(self) -> int:
        return int(self.canary.get("weight", 0))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeploymentSpec":
        """A stored revision (validated by control when it was applied)."""
        return cls(name=data["name"], model=data["model"], aliases=list(data.get("aliases", [])),
                   engine=dict(data.get("engine", {})), replicas=Replicas(**data.get("replicas", {})),
                   slo=Slo(**data.get("slo", {})), routing=dict(data.get("routing", {"policy": "kv_aware"})),
                   canary=dict(data.get("canary", {"weight": 0})), scaling=Scaling(**data.get("scaling", {})),
                   adapters=[dict(a) for a in data.get("adapters", [])])

    def without_adapters(self) -> dict[str, Any]:
        """The spec as a revision knows it: everything but the live adapters."""
        return {k: v for k, v in self.to_dict().items() if k != "adapters"}


@dataclass
class DeploymentState:
    name: str
    latest: int = 0
    stable: int = 0
    canary: int = 0  # 0: no canary
    canary_weight: int = 0  # percent of traffic to the canary
    routing_policy: str = "kv_aware"
    generation: int = 0
    updated_at: float = 0.0

    @classmethod
    def from_hash(cls, name: str, raw: dict) -> "DeploymentState":
        def num(field: str) -> int:
            return int(raw.get(field.encode(), b"0"))

        return cls(name, num("latest"), num("stable"), num("canary"), num("canary_weight"),
                   raw.get(b"routing_policy", b"kv_aware").decode(), num("generation"),
                   float(raw.get(b"updated_at", b"0")))

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items() if k != "name"}

    def serving(self) -> dict[int, int]:
        """Revision -> percent of traffic."""
        if self.canary and self.canary_weight:
            return {self.stable: 100 - self.canary_weight, self.canary: self.canary_weight}
        return {self.stable: 100} if self.stable else {}

    def revision_for(self, draw: float) -> int:
        """The revision a request goes to, for a uniform draw in [0, 1)."""
        if self.canary and draw * 100 < self.canary_weight:
            return self.canary
        return self.stable


async def read_state(redis: aioredis.Redis, name: str) -> DeploymentState | None:
    raw = await redis.hgetall(keys.deployment(name))
    return DeploymentState.from_hash(name, raw) if raw and b"stable" in raw else None


async def read_spec(redis: aioredis.Redis, name: str, revision: int) -> DeploymentSpec | None:
    raw = await redis.get(keys.deployment_revision(name, revision))
    return DeploymentSpec.from_dict(json.loads(raw)) if raw else None


async def list_names(redis: aioredis.Redis) -> list[str]:
    return sorted(m.decode() for m in await redis.smembers(keys.DEPLOYMENTS))


async def history(redis: aioredis.Redis, name: str) -> list[dict]:
    return [json.loads(e) for e in await redis.lrange(keys.deployment_history(name), 0, -1)]


async def revisions(redis: aioredis.Redis, name: str, latest: int) -> dict[int, DeploymentSpec]:
    specs = {}
    for rev in range(1, latest + 1):
        spec = await read_spec(redis, name, rev)
        if spec is not None:
            specs[rev] = spec
    return specs




@dataclass
class Deployment:
    """A deployment as a reader needs it: its state and the specs of the revisions serving."""

    state: DeploymentState
    specs: dict[int, DeploymentSpec]  # serving revision -> spec

    @property
    def stable_spec(self) -> DeploymentSpec:
        return self.specs[self.state.stable]


async def load(redis: aioredis.Redis, name: str) -> Deployment | None:
    state = await read_state(redis, name)
    if state is None:
        return None
    specs = {}
    for rev in state.serving():
        spec = await read_spec(redis, name, rev)
        if spec is not None:
            specs[rev] = spec
    return Deployment(state, specs) if state.stable in specs else None


class DeploymentWatcher:
    """A live copy of all deployments; on_change(name, deployment or None) runs after each
    change this copy sees (None: deleted)."""

    def __init__(self, redis: aioredis.Redis, on_change: Callable[[str, Deployment | None], Awaitable[None]] | None = None,
                 resync_interval: float = 5.0):
        self.redis = redis
        self.on_change = on_change
        self.resync_interval = resync_interval
        self.deployments: dict[str, Deployment] = {}
        self._task: asyncio.Task | None = None

    async def start(self, bus) -> None:
        await bus.subscribe(protocol.CONTROL_DEPLOYMENTS, protocol.DeploymentChanged, self._on_announcement)
        try:
            await self.resync()
        except Exception as exc:  # Redis away: the periodic resync catches up
            log.warning("deployments resync failed", error=str(exc))
        self._task = asyncio.create_task(self._resync_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _on_announcement(self, msg: protocol.DeploymentChanged, _raw) -> None:
        await self.refresh(msg.name)

    async def refresh(self, name: str) -> None:
        deployment = await load(self.redis, name)
        before = self.deployments.get(name)
        if deployment is None:
            self.deployments.pop(name, None)
        else:
            self.deployments[name] = deployment
        changed = (before is None) != (deployment is None) or (
            before is not None and before.state.generation != deployment.state.generation)
        if changed and self.on_change is not None:
            await self.on_change(name, deployment)

    async def resync(self) -> None:
        names = set(await list_names(self.redis)) | set(self.deployments)
        for name in names:
            await self.refresh(name)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_interval)
            try:
                await self.resync()
            except Exception as exc:
                log.warning("deployments resync failed", error=str(exc))
