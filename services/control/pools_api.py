"""Control's REST API for capacity pools (admin key): the stored specs (tokens never shown) with
what the scaler reports of each (capacity, used, cost, refusals, back-off), and the changes,
each announced on CONTROL_POOLS so the scaler acts on it at once.

    GET    /api/v1/pools            every pool, and the deployments short of capacity
    POST   /api/v1/pools            apply pools: one pool, a list, or {pools: [...]} (YAML or JSON)
    GET    /api/v1/pools/{name}
    PATCH  /api/v1/pools/{name}     change capacity, cost_per_hour, cold_start_s, labels or region
    DELETE /api/v1/pools/{name}     the pool retires: its replicas move to the others first
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import yaml
from aiohttp import web

from services.control.fleet import FleetView
from services.control.pools import PoolStore
from shared import protocol
from shared.bus import Bus
from shared.deployments import Placement
from shared.logging import get_logger
from shared.pools import PoolSpec, PoolSpecError, parse_pools

log = get_logger()


def unknown_pools(placement: Placement, known: set[str]) -> list[tuple[str, str]]:
    """A deployment's placement naming pools control does not store: (field, reason) errors."""
    errors = []
    for field, names in (("placement.pools", placement.pools), ("placement.shares", list(placement.shares))):
        missing = sorted(set(names) - known)
        if missing:
            errors.append((field, f"no such pool: {', '.join(missing)} (pools: {', '.join(sorted(known)) or 'none'})"))
    return errors


class PoolsApi:
    """`redis` and `bus` are called when a request comes (the service connects them at start)."""

    def __init__(self, redis: Callable[[], object], fleet: FleetView, bus: Callable[[], Bus],
                 admin: Callable[[web.Request], Awaitable[object]]):
        self.redis, self.fleet, self.bus, self.admin = redis, fleet, bus, admin

    @property
    def store(self) -> PoolStore:
        return PoolStore(self.redis())

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/api/v1/pools", self.list)
        router.add_post("/api/v1/pools", self.apply)
        router.add_get("/api/v1/pools/{name}", self.get)
        router.add_patch("/api/v1/pools/{name}", self.set)
        router.add_delete("/api/v1/pools/{name}", self.delete)

    async def _announce(self, name: str, action: str, generation: int) -> None:
        await self.bus().publish(protocol.CONTROL_POOLS, protocol.PoolChanged(name=name, action=action,
                                                                             generation=generation))
        log.info("pool changed", pool=name, action=action, generation=generation)

    def _describe(self, spec: PoolSpec | None, name: str, reports: dict) -> dict:
        report = reports.get(name)
        return {"name": name, "spec": spec.to_dict(redact=True) if spec else None,
                "status": report.to_dict() if report else None}

    async def overview(self) -> dict:
        """Every stored pool and every pool the scaler reports (its own `default` included),
        with the deployments short of capacity."""
        specs = await self.store.list()
        status = self.fleet.pool_status()
        reports = {p.name: p for p in status.pools} if status else {}
        return {"pools": [self._describe(specs.get(n), n, reports) for n in sorted(set(specs) | set(reports))],
                "short": dict(status.short) if status else {}, "wanted": dict(status.wanted) if status else {},
                "scaler": status.scaler_id if status else None}

    async def list(self, request: web.Request) -> web.Response:
        await self.admin(request)
        return web.json_response(await self.overview())

    async def get(self, request: web.Request) -> web.Response:
        await self.admin(request)
        name = request.match_info["name"]
        status = self.fleet.pool_status()
        reports = {p.name: p for p in status.pools} if status else {}
        specs = await self.store.list()
        if name not in specs and name not in reports:
            await self.store.get(name)  # 404
        return web.json_response(self._describe(specs.get(name), name, reports))

    async def apply(self, request: web.Request) -> web.Response:
        await self.admin(request)
        pools = parse_pools(_parse_text(await request.text()) if request.can_read_body else None)
        applied = []
        for spec in pools:
            stored = await self.store.apply(spec)
            await self._announce(stored.name, "apply", stored.generation)
            applied.append(stored.to_dict(redact=True))
        return web.json_response({"pools": applied}, status=201)

    async def set(self, request: web.Request) -> web.Response:
        await self.admin(request)
        try:
            changes = await request.json()
        except ValueError:
            raise PoolSpecError([("(body)", "not valid JSON")]) from None
        if not isinstance(changes, dict):
            raise PoolSpecError([("(body)", "must be a JSON object of the fields to change")])
        stored = await self.store.set(request.match_info["name"], changes)
        await self._announce(stored.name, "set", stored.generation)
        return web.json_response({"pool": stored.to_dict(redact=True), "changed": sorted(changes)})

    async def delete(self, request: web.Request) -> web.Response:
        await self.admin(request)
        name = request.match_info["name"]
        await self.store.delete(name)
        await self._announce(name, "delete", 0)
        return web.json_response({"deleted": name})


def _parse_text(text: str) -> Any:
    """YAML or JSON text (JSON is YAML)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PoolSpecError([("(file)", f"not valid YAML or JSON: {exc}")]) from None
