"""API keys (stored hashed in Redis) and per-key rate limits shared by every gateway replica."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys

KEY_PREFIX = "sk-strata-"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass
class ApiKey:
    key_hash: str
    tenant: str
    rpm: int  # requests per minute, 0 = unlimited
    tpm: int  # tokens (prompt + max_tokens) per minute, 0 = unlimited
    priority: str = "standard"
    admin: bool = False


async def create_key(redis: aioredis.Redis, name: str, rpm: int = 0, tpm: int = 0, priority: str = "standard",
                     admin: bool = False, api_key: str | None = None) -> str:
    """Store a key (a new random one unless given) and return it; only its hash is kept."""
    api_key = api_key or KEY_PREFIX + secrets.token_urlsafe(24)
    await redis.hset(keys.api_key(hash_key(api_key)), mapping={
        "tenant": name, "rpm": rpm, "tpm": tpm, "priority": priority, "admin": int(admin),
        "created": int(time.time())})
    return api_key


def key_id(key_hash: str) -> str:
    """The short, non-secret name of a key: the start of its hash (`strata keys list` shows it)."""
    return key_hash[:12]


async def list_keys(redis: aioredis.Redis) -> list[dict]:
    """Every stored key's id, tenant, limits and creation time (never the key: only its hash is stored)."""
    out = []
    async for name in redis.scan_iter(match=keys.api_key("*"), count=500):
        key_hash = name.decode().rsplit(":", 1)[1]
        f = {k.decode(): v.decode() for k, v in (await redis.hgetall(name)).items()}
        if f:
            out.append({"id": key_id(key_hash), "name": f.get("tenant", ""), "rpm": int(f.get("rpm", 0)),
                        "tpm": int(f.get("tpm", 0)), "priority": f.get("priority", "standard"),
                        "admin": f.get("admin", "0") == "1", "created": int(f.get("created", 0))})
    return sorted(out, key=lambda k: (k["created"], k["id"]))


class KeyNotFound(LookupError):
    pass


async def revoke_key(redis: aioredis.Redis, which: str) -> str:
    """Delete a key named by its id (a hash prefix of at least 8 characters) or by the key itself;
    returns its full hash. KeyNotFound when none or several match."""
    if which.startswith(KEY_PREFIX):
        candidates = [hash_key(which)]
    elif len(which) >= 8 and all(c in "0123456789abcdef" for c in which):
        candidates = [name.decode().rsplit(":", 1)[1]
                      async for name in redis.scan_iter(match=keys.api_key(which + "*"), count=500)]
    else:
        raise KeyNotFound(f"{which!r} is neither a key id (8 or more hex characters) nor an API key")
    if len(candidates) > 1:
        raise KeyNotFound(f"key id {which} matches {len(candidates)} keys: give more of it")
    if not candidates or not await redis.delete(keys.api_key(candidates[0])):
        raise KeyNotFound(f"no API key {which}")
    return candidates[0]


class KeyStore:
    """Looks keys up in Redis with a short local cache, and enforces the per-minute limits."""

    def __init__(self, redis: aioredis.Redis, cache_ttl: float = 10.0, cache_size: int = 10_000):
        self.redis = redis
        self.cache_ttl = cache_ttl
        self.cache_size = cache_size  # bounded: random bearer tokens must not grow memory
        self._cache: OrderedDict[str, tuple[ApiKey | None, float]] = OrderedDict()

    async def authenticate(self, authorization: str) -> ApiKey:
        """The key of an `Authorization: Bearer <key>` header, or an OpenAI-shaped ApiError:
        401 when missing or unknown, 503 when the key store cannot answer."""
        from services.gateway.openai_api import ApiError

        if not authorization.startswith("Bearer ") or not authorization[7:].strip():
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error",
                           None, "invalid_api_key")
        try:
            key = await self.lookup(authorization[7:].strip())
        except Exception:
            raise ApiError(503, "key store unavailable, try again", "overloaded_error", None, "unavailable",
                           retry_after=1.0) from None
        if key is None:
            raise ApiError(401, "invalid API key", "authentication_error", None, "invalid_api_key")
        return key

    async def lookup(self, api_key: str) -> ApiKey | None:
        h = hash_key(api_key)
        hit = self._cache.get(h)
        now = time.monotonic()
        if hit is not None and hit[1] > now:
            return hit[0]
        try:
            raw = await self.redis.hgetall(keys.api_key(h))
        except Exception:
            if hit is not None:  # Redis away: trust what we knew a moment ago
                return hit[0]
            raise
        record = None
        if raw:
            f = {k.decode(): v.decode() for k, v in raw.items()}
            record = ApiKey(h, f["tenant"], int(f.get("rpm", 0)), int(f.get("tpm", 0)),
                            f.get("priority", "standard"), f.get("admin", "0") == "1")
        self._cache[h] = (record, now + self.cache_ttl)
        self._cache.move_to_end(h)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return record

    def forget(self, key_hash: str) -> None:
        """Drop a cached lookup (the key was revoked): the next request reads Redis."""
        self._cache.pop(key_hash, None)

    async def charge(self, key: ApiKey, tokens: int) -> tuple[str, float] | None:
        """Count one request and `tokens` against this minute's window. Returns (what, seconds
        to wait) when over a limit (and takes the charge back), None when allowed."""
        if not key.rpm and not key.tpm:
            return None
        now = time.time()
        window = int(now // 60)
        retry_after = 60 - (now % 60)
        req_key = keys.rate_counter(key.key_hash, "requests", window)
        tok_key = keys.rate_counter(key.key_hash, "tokens", window)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.incr(req_key).expire(req_key, 120).incrby(tok_key, tokens).expire(tok_key, 120)
                requests, _, used, _ = await pipe.execute()
        except Exception:
            return None  # Redis away: fail open rather than refuse everyone
        over = None
        if key.rpm and requests > key.rpm:
            over = "requests"
        elif key.tpm and used > key.tpm:
            over = "tokens"
        if over is None:
            return None
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.decr(req_key).decrby(tok_key, tokens)
                await pipe.execute()
        except Exception:
            pass
        return over, retry_after

    async def settle(self, key: ApiKey, charged: int, used: int, charged_at: float) -> None:
        """Replace a request's estimated tokens (prompt + max_tokens) by what it used, in the
        window it was charged to; a window already over needs nothing."""
        window = int(charged_at // 60)
        if not key.tpm or used >= charged or int(time.time() // 60) != window:
            return
        try:
            await self.redis.decrby(keys.rate_counter(key.key_hash, "tokens", window), charged - used)
        except Exception:
            pass  # Redis away: the estimate stands
