"""Redis (or Valkey) connections for the services, and how they notice the store lost its data.

A URL is a plain server (`redis://host:6379/0`) or a set of Sentinels watching a primary with
replicas: `redis+sentinel://host1:26379,host2:26379/<primary name>/<db>` (the primary name
defaults to `strata`, db to 0). With Sentinels, every connection asks them where the primary is,
and after a failover the next command goes to the new one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis

from shared import keys

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_PRIMARY = "strata"


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: list[tuple[str, int]]
    primary: str = DEFAULT_PRIMARY
    db: int = 0
    password: str | None = None  # of the data servers (Sentinels without one)


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The parts of a `redis+sentinel://` URL, None for any other URL; ValueError if malformed."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    netloc = parts.netloc.rsplit("@", 1)
    password = unquote(netloc[0].partition(":")[2]) or None if len(netloc) == 2 else None
    sentinels = []
    for node in netloc[-1].split(","):
        host, _, port = node.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{url}: every Sentinel is host:port, got {node!r}")
        sentinels.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{url}: the path is /<primary name>/<db>")
    return SentinelUrl(sentinels, path[0] if path else DEFAULT_PRIMARY, int(path[1]) if len(path) == 2 else 0,
                       password)


def _client_options(name: str) -> dict:
    """Timeouts on connect and every command, and retries across brief outages (a failover)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return dict(client_name=name, decode_responses=False, socket_connect_timeout=2.0, socket_timeout=5.0,
                health_check_interval=10, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5))


def connect_redis(url: str, name: str = "strata") -> aioredis.Redis:
    """An asyncio client of the server, or of the primary the Sentinels name."""
    sentinel = parse_sentinel_url(url)
    if sentinel is None:
        return aioredis.Redis.from_url(url, **_client_options(name))
    from redis.asyncio.sentinel import Sentinel

    watchers = Sentinel(sentinel.sentinels, socket_connect_timeout=1.0, socket_timeout=1.0)
    return watchers.master_for(sentinel.primary, db=sentinel.db, password=sentinel.password,
                               **_client_options(name))


def connect_redis_sync(url: str, name: str = "strata"):
    """The same, blocking (tools and the local stack's readiness checks)."""
    import redis

    sentinel = parse_sentinel_url(url)
    if sentinel is None:
        return redis.Redis.from_url(url, **_client_options(name))
    from redis.sentinel import Sentinel

    watchers = Sentinel(sentinel.sentinels, socket_connect_timeout=1.0, socket_timeout=1.0)
    return watchers.master_for(sentinel.primary, db=sentinel.db, password=sentinel.password,
                               **_client_options(name))


class StoreEpoch:
    """Tells when the store lost its data, so that a service treats an empty store as an outage
    to alarm on (and to restore what it holds) rather than as the truth ("every deployment was
    deleted", "every key was revoked").

    The store carries a random epoch (keys.STORE_EPOCH), written by the first service that finds
    none. A store restarted without its data, or a replica without it taking over, has none (or
    one written since): a service that saw another epoch before knows the data is gone.
    """

    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self.known: bytes | None = None

    async def lost(self) -> bool:
        """True (once) when the store lost its data since the last call; the first call only learns
        the epoch. Raises what Redis raises when it cannot answer."""
        current = await self.redis.get(keys.STORE_EPOCH)
        if current is None:
            await self.redis.set(keys.STORE_EPOCH, uuid.uuid4().hex, nx=True)
            current = await self.redis.get(keys.STORE_EPOCH)
        lost = self.known is not None and current != self.known
        self.known = current
        return lost
