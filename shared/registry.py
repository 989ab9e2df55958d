"""The replica registry in Redis: each engine's entry lives as long as its lease is refreshed."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from shared import keys
from shared.logging import get_logger

log = get_logger()


async def refresh(redis: aioredis.Redis, replica_id: str, model: str, fields: dict, ttl: float) -> None:
    """Write (or refresh) a replica's entry with a TTL lease, and list it under its model."""
    key = keys.replica(replica_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={k: str(v) for k, v in fields.items()})
        pipe.pexpire(key, int(ttl * 1000))
        pipe.sadd(keys.model_replicas(model), replica_id)
        pipe.sadd(keys.MODELS, model)
        await pipe.execute()


async def remove(redis: aioredis.Redis, replica_id: str, model: str) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.replica(replica_id))
        pipe.srem(keys.model_replicas(model), replica_id)
        await pipe.execute()


async def sweep(redis: aioredis.Redis, model: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """(live replicas with their fields, replicas whose lease is gone); prunes the gone ones."""
    members = [m.decode() for m in await redis.smembers(keys.model_replicas(model))]
    if not members:
        return {}, []
    async with redis.pipeline(transaction=False) as pipe:
        for m in members:
            pipe.hgetall(keys.replica(m))
        entries = await pipe.execute()
    live, dead = {}, []
    for m, entry in zip(members, entries):
        if entry:
            live[m] = {k.decode(): v.decode() for k, v in entry.items()}
        else:
            dead.append(m)
    if dead:
        await redis.srem(keys.model_replicas(model), *dead)
    return live, dead


async def models(redis: aioredis.Redis) -> list[str]:
    """Models that have (or had) registered replicas."""
    return sorted(m.decode() for m in await redis.smembers(keys.MODELS))


async def announce(redis: aioredis.Redis, kind: str, instance: str, fields: dict, ttl: float) -> None:
    """Register (or refresh) a gateway's or scheduler's entry, so tools can find its /metrics."""
    key = keys.service(kind, instance)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={k: str(v) for k, v in fields.items()})
        pipe.pexpire(key, int(ttl * 1000))
        pipe.sadd(keys.services(kind), instance)
        await pipe.execute()


async def keep_announced(redis: aioredis.Redis, kind: str, instance: str, fields: dict, interval: float = 1.0,
                         ttl: float = 5.0) -> None:
    """announce() every `interval` seconds until cancelled; Redis trouble only delays it."""
    while True:
        try:
            await announce(redis, kind, instance, fields, ttl)
        except Exception as exc:
            log.warning("service registration failed", kind=kind, error=str(exc))
        await asyncio.sleep(interval)


async def services(redis: aioredis.Redis, kind: str) -> dict[str, dict[str, str]]:
    """Live instances of one kind of service with their fields; prunes those whose lease is gone."""
    members = sorted(m.decode() for m in await redis.smembers(keys.services(kind)))
    async with redis.pipeline(transaction=False) as pipe:
        for m in members:
            pipe.hgetall(keys.service(kind, m))
        entries = await pipe.execute()
    dead = [m for m, e in zip(members, entries) if not e]
    if dead:
        await redis.srem(keys.services(kind), *dead)
    return {m: {k.decode(): v.decode() for k, v in e.items()} for m, e in zip(members, entries) if e}
