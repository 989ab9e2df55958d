"""Capacity pools as every service reads them. A pool is a named place that can run replicas:
an actuator (a Kubernetes cluster, or engine processes on the scaler's machine), a region, a
capacity in replicas (changeable at run time), a cost per replica-hour, a cold-start estimate
and labels (the accelerator kind, ...). Written only by control (services.control.pools);
read by the scaler, which places each deployment's replicas across them
(services.scaler.placement), and by `strata simulate --pools`, which reads the same format.

    name: spot-east
    region: us-east
    capacity: 120                 # replicas, all deployments together
    cost_per_hour: 2.1            # per replica
    cold_start_s: 30              # the estimate until the scaler has measured one
    labels: {accelerator: h100}
    actuator:
      kind: kubernetes            # or local: engine processes on the scaler's machine
      api_url: https://k8s.us-east.example:6443
      namespace: strata
      token_file: /etc/strata/us-east.token   # or token: ... (never shown by the API)
      ca_file: /etc/strata/us-east-ca.crt     # the API server's CA (a file missing: the pool refuses)
      deployment_prefix: strata-engine-
      pending_timeout_s: 300      # a pod not ready this long after it was asked for: the pool refuses

`parse_pool` checks a spec and reports every error at once, naming the field.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import redis.asyncio as aioredis

from shared import keys, protocol
from shared.deployments import NAME_RE
from shared.logging import get_logger

log = get_logger()

ACTUATOR_KINDS = ("kubernetes", "local")
REDACTED = "(set)"
DEFAULT_POOL = "default"  # the scaler's own actuator, the one pool while control stores none (reserved)
UNLIMITED = 2**31 - 1  # the capacity of `default`


@dataclass
class ActuatorSpec:
    kind: str = "local"
    api_url: str = ""  # kubernetes: the cluster's API server
    namespace: str = "default"
    token: str = ""  # kubernetes: a bearer token (stored in Redis; the API shows only that it is set)
    token_file: str = ""  # kubernetes: a file on the scaler's machine holding the token
    ca_file: str = ""  # kubernetes: the CA bundle of the API server's certificate
    deployment_prefix: str = "strata-engine-"
    pending_timeout_s: float = 300.0  # kubernetes: pods not ready this long after asked for = refused


@dataclass
class PoolSpec:
    name: str
    region: str = ""
    capacity: int = 0
    cost_per_hour: float = 0.0
    cold_start_s: float = 30.0
    labels: dict[str, str] = field(default_factory=dict)
    actuator: ActuatorSpec = field(default_factory=ActuatorSpec)
    generation: int = 0  # control counts every change of this pool

    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if redact and out["actuator"]["token"]:
            out["actuator"]["token"] = REDACTED
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PoolSpec":
        """A stored pool (checked by parse_pool when control stored it)."""
        data = dict(data)
        data["actuator"] = ActuatorSpec(**data.get("actuator", {}))
        data["labels"] = dict(data.get("labels", {}))
        return cls(**data)


class PoolSpecError(ValueError):
    """An invalid pool spec; `errors` lists (field, reason) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{f}: {r}" for f, r in errors))


def _number(value: Any, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (isinstance(value, int) or not integer) and math.isfinite(value)


def parse_pool(data: Any, extra: tuple[str, ...] = ()) -> PoolSpec:
    """The pool, or PoolSpecError listing every problem. `extra` names fields a caller reads
    itself (the simulator's `outages`): they are allowed here and ignored."""
    if not isinstance(data, dict):
        raise PoolSpecError([("(pool)", "must be a mapping of fields")])
    errors: list[tuple[str, str]] = []
    known = {"name", "region", "capacity", "cost_per_hour", "cold_start_s", "labels", "actuator", *extra}
    for key in data:
        if key not in known:
            errors.append((str(key), f"unknown field (known: {', '.join(sorted(known))})"))
    name = data.get("name")
    if name is None:
        errors.append(("name", "required"))
    elif not isinstance(name, str) or not NAME_RE.match(name):
        errors.append(("name", "must be 1-63 letters, digits, '-' or '_', starting with a letter or digit"))
    elif name == DEFAULT_POOL:
        errors.append(("name", f"{DEFAULT_POOL!r} is reserved for the scaler's own actuator"))
    region = data.get("region", "")
    if not isinstance(region, str) or (region and not NAME_RE.match(region)):
        errors.append(("region", "must be a name (letters, digits, '-' or '_')"))
    capacity = data.get("capacity")
    if capacity is None:
        errors.append(("capacity", "required (replicas this pool may hold)"))
    elif not _number(capacity, integer=True) or capacity < 0:
        errors.append(("capacity", f"must be a whole number of replicas, 0 or more, got {capacity!r}"))
    for key, default in (("cost_per_hour", 0.0), ("cold_start_s", 30.0)):
        value = data.get(key, default)
        if not _number(value) or value < 0:
            errors.append((key, f"must be a number, 0 or more, got {value!r}"))
    labels = data.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        errors.append(("labels", "must be a mapping of strings to strings (e.g. accelerator: h100)"))
        labels = {}
    actuator = _parse_actuator(data.get("actuator", {"kind": "local"}), errors)
    if errors:
        raise PoolSpecError(errors)
    return PoolSpec(name=name, region=region, capacity=int(capacity), cost_per_hour=float(data.get("cost_per_hour", 0.0)),
                    cold_start_s=float(data.get("cold_start_s", 30.0)), labels=dict(labels), actuator=actuator)


def _parse_actuator(raw: Any, errors: list) -> ActuatorSpec:
    if not isinstance(raw, dict):
        errors.append(("actuator", "must be a mapping with a kind (kubernetes or local)"))
        return ActuatorSpec()
    fields = {f for f in ActuatorSpec.__dataclass_fields__}
    for key in raw:
        if key not in fields:
            errors.append((f"actuator.{key}", f"unknown field (known: {', '.join(sorted(fields))})"))
    kind = raw.get("kind")
    if kind not in ACTUATOR_KINDS:
        errors.append(("actuator.kind", f"must be one of {', '.join(ACTUATOR_KINDS)}, got {kind!r}"))
        return ActuatorSpec()
    values: dict[str, Any] = {"kind": kind}
    for key in fields - {"kind", "pending_timeout_s"}:
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            errors.append((f"actuator.{key}", f"must be a string, got {type(value).__name__}"))
        elif value is not None:
            values[key] = value
    timeout = raw.get("pending_timeout_s", ActuatorSpec.pending_timeout_s)
    if not _number(timeout) or timeout <= 0:
        errors.append(("actuator.pending_timeout_s", f"must be a positive number of seconds, got {timeout!r}"))
    else:
        values["pending_timeout_s"] = float(timeout)
    if kind == "kubernetes":
        if not values.get("api_url"):
            errors.append(("actuator.api_url", "required for a kubernetes pool (the cluster's API server)"))
        elif not values["api_url"].startswith(("https://", "http://")):
            errors.append(("actuator.api_url", "must be an http(s) URL"))
        if values.get("token") and values.get("token_file"):
            errors.append(("actuator.token", "give token or token_file, not both"))
    else:  # a stored spec reads back with every field: the defaults are no settings
        default = ActuatorSpec()
        extra = sorted(k for k in set(values) - {"kind", "pending_timeout_s"} if values[k] != getattr(default, k))
        if extra:
            errors.append((f"actuator.{extra[0]}", "only kubernetes pools take cluster settings"))
    return ActuatorSpec(**values)


def parse_pools(data: Any, extra: tuple[str, ...] = ()) -> list[PoolSpec]:
    """A pools file: a list of pools, or a mapping with `pools:` (a list); errors name the pool."""
    items = data.get("pools") if isinstance(data, dict) and set(data) == {"pools"} else data
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        raise PoolSpecError([("pools", "must be a non-empty list of pools")])
    errors, out = [], []
    for i, item in enumerate(items):
        label = item.get("name") if isinstance(item, dict) and isinstance(item.get("name"), str) else f"[{i}]"
        try:
            out.append(parse_pool(item, extra))
        except PoolSpecError as exc:
            errors.extend((f"pools.{label}.{f}", r) for f, r in exc.errors)
    names = [p.name for p in out]
    for name in sorted({n for n in names if names.count(n) > 1}):
        errors.append((f"pools.{name}", "defined twice"))
    if errors:
        raise PoolSpecError(errors)
    return out


# ---- Redis -------------------------------------------------------------------------------------
async def read_pools(redis: aioredis.Redis) -> dict[str, PoolSpec]:
    names = sorted(m.decode() for m in await redis.smembers(keys.POOLS))
    if not names:
        return {}
    raws = await redis.mget([keys.pool(n) for n in names])
    return {n: PoolSpec.from_dict(json.loads(raw)) for n, raw in zip(names, raws) if raw}


class PoolWatcher:
    """A live copy of the pools; on_change(pools) runs after every change this copy sees.
    Pools are few: every announcement re-reads them all, and a periodic resync heals a lost one."""

    def __init__(self, redis: aioredis.Redis, on_change: Callable[[dict[str, PoolSpec]], Awaitable[None]] | None = None,
                 resync_interval: float = 5.0):
        self.redis = redis
        self.on_change = on_change
        self.resync_interval = resync_interval
        self.pools: dict[str, PoolSpec] = {}
        self._task: asyncio.Task | None = None

    async def start(self, bus) -> None:
        await bus.subscribe(protocol.CONTROL_POOLS, protocol.PoolChanged, self._on_announcement)
        try:
            await self.resync()
        except Exception as exc:  # Redis away: the periodic resync catches up
            log.warning("pools resync failed", error=str(exc))
        self._task = asyncio.create_task(self._resync_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _on_announcement(self, _msg: protocol.PoolChanged, _raw) -> None:
        await self.resync()

    async def resync(self) -> None:
        pools = await read_pools(self.redis)
        changed = pools != self.pools
        self.pools = pools
        if changed and self.on_change is not None:
            await self.on_change(pools)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_interval)
            try:
                await self.resync()
            except Exception as exc:
                log.warning("pools resync failed", error=str(exc))
