"""The LoRA adapters each model (deployment) serves: one registry in Redis that every service
reads, written by control (a deployment spec's `adapters`) and by the gateway's
/v1/load_lora_adapter and /v1/unload_lora_adapter.

    strata:lora:<model>   hash: adapter name -> {"path": ..., "source": "spec" | "api"}

Every change is announced on protocol.lora_adapters(model). Engines register and unregister
adapters to match (services.engine.service), gateways serve them as model names
(`"base:adapter"` or the adapter's own name) and list them in /v1/models with their parent.
Adapters are live state of a deployment, not part of a revision: changing them starts and
stops nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys, protocol

# No ':' (it separates base and adapter in a model name) and nothing a subject token refuses.
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
SOURCES = ("spec", "api")


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    source: str = "api"


def check_name(name) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        return "must be 1-63 letters, digits, '.', '-' or '_' (no ':'), starting with a letter or digit"
    return None


def split_model(name: str) -> tuple[str, str | None]:
    """'base:adapter' -> ('base', 'adapter'); a plain name -> (name, None)."""
    base, sep, adapter = name.partition(":")
    return (base, adapter) if sep and adapter else (name, None)


async def read(redis: aioredis.Redis, model: str) -> dict[str, Adapter]:
    raw = await redis.hgetall(keys.lora_adapters(model))
    out = {}
    for name, value in raw.items():
        entry = json.loads(value)
        out[name.decode()] = Adapter(name.decode(), entry["path"], entry.get("source", "api"))
    return out


async def put(redis: aioredis.Redis, model: str, adapter: Adapter) -> None:
    await redis.hset(keys.lora_adapters(model), adapter.name,
                     json.dumps({"path": adapter.path, "source": adapter.source}))


async def remove(redis: aioredis.Redis, model: str, name: str) -> bool:
    return bool(await redis.hdel(keys.lora_adapters(model), name))


async def replace_declared(redis: aioredis.Redis, model: str, declared: list[dict]) -> tuple[list[str], list[str]]:
    """Make the spec-declared adapters exactly `declared` ([{name, path}]); adapters loaded over
    the API stay unless a declared one takes their name. Returns (added or changed, removed)."""
    current = await read(redis, model)
    wanted = {a["name"]: Adapter(a["name"], a["path"], "spec") for a in declared}
    changed = [n for n, a in wanted.items() if current.get(n) != a]
    removed = [n for n, a in current.items() if a.source == "spec" and n not in wanted]
    async with redis.pipeline(transaction=True) as pipe:
        for name in removed:
            pipe.hdel(keys.lora_adapters(model), name)
        for name in changed:
            a = wanted[name]
            pipe.hset(keys.lora_adapters(model), name, json.dumps({"path": a.path, "source": a.source}))
        await pipe.execute()
    return changed, removed


async def announce(bus, model: str, action: str, name: str | None = None) -> None:
    await bus.publish(protocol.lora_adapters(model), protocol.LoraAdaptersChanged(model=model, action=action, name=name))
