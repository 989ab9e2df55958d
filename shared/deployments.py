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
import re
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


PLACEMENT_PREFERENCES = ("cheapest", "nearest", "pinned")


@dataclass
class Placement:
    """Where the replicas may run (capacity pools, shared.pools) and which pools come first
    (services.scaler.placement)."""

    pools: list[str] = field(default_factory=list)  # the pools allowed (empty: every pool)
    prefer: str = "cheapest"  # cheapest | nearest (pools in `region` first) | pinned (`shares`)
    region: str = ""  # nearest: the region whose pools come first
    shares: dict[str, int] = field(default_factory=dict)  # pinned: percent of the replicas per pool
    min_pools: int = 1  # spread: at least this many pools hold one, once there are that many replicas
    labels: dict[str, str] = field(default_factory=dict)  # only pools with these labels (accelerator: h100)


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")  # deployment, alias, pool and region names


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_placement(raw: Any, errors: list) -> Placement:
    """A spec's `placement` section (None: the defaults); problems go to `errors` as (field,
    reason). Pool names are checked against the stored pools by control when it applies a spec
    (pools are live); the simulator reads the same section from its pools file."""
    if raw is None:
        return Placement()
    if not isinstance(raw, dict):
        errors.append(("placement", "must be a mapping (pools, prefer, region, shares, min_pools, labels)"))
        return Placement()
    known = [f.name for f in dataclasses.fields(Placement)]
    for key in raw:
        if key not in known:
            errors.append((f"placement.{key}", f"unknown field (known: {', '.join(known)})"))
    out = Placement()
    pools = raw.get("pools", [])
    if not isinstance(pools, list) or not all(isinstance(p, str) and NAME_RE.match(p) for p in pools):
        errors.append(("placement.pools", "must be a list of pool names"))
    else:
        out.pools = list(pools)
    prefer = raw.get("prefer", "cheapest")
    if prefer not in PLACEMENT_PREFERENCES:
        errors.append(("placement.prefer", f"must be one of {', '.join(PLACEMENT_PREFERENCES)}, got {prefer!r}"))
    else:
        out.prefer = prefer
    region = raw.get("region", "")
    if not isinstance(region, str):
        errors.append(("placement.region", "must be a region name"))
    elif prefer == "nearest" and not region:
        errors.append(("placement.region", "required with prefer: nearest (the region whose pools come first)"))
    else:
        out.region = region
    shares = raw.get("shares", {})
    if not isinstance(shares, dict) or not all(isinstance(k, str) and _whole(v) and 0 <= v <= 100
                                               for k, v in shares.items()):
        errors.append(("placement.shares", "must map pool names to integer percentages"))
    elif prefer == "pinned" and sum(shares.values()) != 100:
        errors.append(("placement.shares", f"must add up to 100 with prefer: pinned, got {sum(shares.values())}"))
    elif shares and prefer != "pinned":
        errors.append(("placement.shares", "only used with prefer: pinned"))
    elif out.pools and set(shares) - set(out.pools):
        errors.append(("placement.shares", f"names pools not in placement.pools: {', '.join(sorted(set(shares) - set(out.pools)))}"))
    else:
        out.shares = dict(shares)
    min_pools = raw.get("min_pools", 1)
    if not _whole(min_pools) or min_pools < 1:
        errors.append(("placement.min_pools", f"must be a whole number, 1 or more, got {min_pools!r}"))
    else:
        out.min_pools = min_pools
    labels = raw.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        errors.append(("placement.labels", "must be a mapping of strings to strings (e.g. accelerator: h100)"))
    else:
        out.labels = dict(labels)
    return out


@dataclass
class Limits:
    default_max_tokens: int = 1024  # chat requests that give no max_tokens (never past the context)


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
    placement: Placement = field(default_factory=Placement)
    limits: Limits = field(default_factory=Limits)
    tool_call_parser: str = ""  # how tool_choice "auto" reads calls (services.gateway.tool_parsers); "": none
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
                   placement=Placement(**data.get("placement", {})),
                   limits=Limits(**data.get("limits", {})), tool_call_parser=data.get("tool_call_parser", ""),
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


async def deleted(redis: aioredis.Redis, name: str) -> bool:
    """Whether control deleted the deployment (recently: the tombstone expires after a day)."""
    return bool(await redis.exists(keys.deployment_deleted(name)))


class DeploymentWatcher:
    """A live copy of all deployments; on_change(name, deployment or None) runs after each
    change this copy sees (None: deleted).

    A deployment leaves the copy only when control deleted it (its tombstone says so). One that
    is missing from the store without a tombstone was lost with the store's data (Valkey restarted
    empty, a failover to a replica without it): the copy holds it, as desired state that stands
    until someone changes it, and lists it in `lost` (an outage to alarm on; control restores it).
    """

    def __init__(self, redis: aioredis.Redis, on_change: Callable[[str, Deployment | None], Awaitable[None]] | None = None,
                 resync_interval: float = 5.0):
        self.redis = redis
        self.on_change = on_change
        self.resync_interval = resync_interval
        self.deployments: dict[str, Deployment] = {}
        self.lost: set[str] = set()  # held, but missing from the store (not deleted)
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
        if deployment is None and before is not None and not await deleted(self.redis, name):
            if name not in self.lost:
                log.error("deployment missing from the store without being deleted: holding its last known state "
                          "(the store lost its data?)", deployment=name, generation=before.state.generation)
                self.lost.add(name)
            return
        self.lost.discard(name)
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
