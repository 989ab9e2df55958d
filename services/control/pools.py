"""Capacity pools in Redis (written by control only; shared.pools reads them):

    strata:pools          set of names
    strata:pool:<name>    the pool's spec (JSON), with its generation

Applying a pool replaces its spec; `set` changes some of its figures at run time (capacity,
cost, cold start, labels, region); every change bumps the generation in one optimistic
transaction, so several control replicas can serve the API at once. The scaler picks changes up
from the announcement on CONTROL_POOLS (services.control.service sends it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from services.control.store import DeploymentError
from shared import keys
from shared.pools import PoolSpec, PoolSpecError, parse_pool, read_pools

SETTABLE = ("capacity", "cost_per_hour", "cold_start_s", "labels", "region")  # `strata pools set`


class PoolStore:
    def __init__(self, redis: aioredis.Redis):
        self.redis = redis

    async def list(self) -> dict[str, PoolSpec]:
        return await read_pools(self.redis)

    async def get(self, name: str) -> PoolSpec:
        raw = await self.redis.get(keys.pool(name))
        if raw is None:
            raise DeploymentError(404, f"pool {name} does not exist", "not_found")
        return PoolSpec.from_dict(json.loads(raw))

    async def apply(self, spec: PoolSpec) -> PoolSpec:
        """Store the pool (new, or replacing its spec); returns it with its new generation."""
        return await self._change(spec.name, lambda _current: spec, create=True)

    async def set(self, name: str, changes: dict[str, Any]) -> PoolSpec:
        """Change some figures of an existing pool; the result is checked like a whole spec."""
        unknown = sorted(set(changes) - set(SETTABLE))
        if unknown:
            raise PoolSpecError([(unknown[0], f"cannot be set on a running pool (settable: {', '.join(SETTABLE)}; "
                                              f"apply the whole spec to change the rest)")])
        if not changes:
            raise PoolSpecError([("(body)", f"nothing to change (settable: {', '.join(SETTABLE)})")])

        def change(current: PoolSpec) -> PoolSpec:
            data = current.to_dict()
            data.pop("generation")
            data.update(changes)
            return parse_pool(data)

        return await self._change(name, change, create=False)

    async def _change(self, name: str, change, create: bool) -> PoolSpec:
        key = keys.pool(name)
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None and not create:
                        raise DeploymentError(404, f"pool {name} does not exist", "not_found")
                    current = PoolSpec.from_dict(json.loads(raw)) if raw else None
                    spec = replace(change(current), generation=(current.generation if current else 0) + 1)
                    pipe.multi()
                    pipe.set(key, json.dumps(spec.to_dict(), sort_keys=True))
                    pipe.sadd(keys.POOLS, name)
                    await pipe.execute()
                    return spec
                except WatchError:
                    continue  # someone else changed it meanwhile: redo on the new spec

    async def delete(self, name: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.pool(name))
            pipe.srem(keys.POOLS, name)
            deleted, _ = await pipe.execute()
        if not deleted:
            raise DeploymentError(404, f"pool {name} does not exist", "not_found")
