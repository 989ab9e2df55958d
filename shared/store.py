"""Redis (or Valkey) connection helper for the asyncio services."""

from __future__ import annotations

import redis.asyncio as aioredis


def connect_redis(url: str, name: str = "strata") -> aioredis.Redis:
    """A client with timeouts on connect and every command, and retries across brief outages."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return aioredis.Redis.from_url(
        url,
        client_name=name,
        decode_responses=False,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
    )
