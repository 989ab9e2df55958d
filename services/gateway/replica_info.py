"""What /v1/models says about the replicas behind each model: which quantization (weights and KV
cache) each live one runs, as its heartbeats wrote it into the registry."""

from __future__ import annotations

from shared import registry
from shared.logging import get_logger

log = get_logger()


async def replica_precision(redis, models: list[str]) -> dict[str, dict]:
    """Served model name -> the `strata` extension of its /v1/models entry:
    {"strata": {"replicas": [{"replica_id", "quantization", "kv_cache_dtype"}, ...]}}. Empty for
    every model while the registry cannot be read (the listing itself does not fail)."""
    out: dict[str, dict] = {name: {} for name in models}
    try:
        for name in models:
            live, _gone = await registry.sweep(redis, name)
            out[name] = {"strata": {"replicas": [
                {"replica_id": rid, "quantization": fields.get("quantization") or "unknown",
                 "kv_cache_dtype": fields.get("kv_cache_dtype") or "unknown"}
                for rid, fields in sorted(live.items())]}}
    except Exception as exc:  # Redis away: list the models without it
        log.warning("replica registry unreadable for /v1/models", error=str(exc))
        return {name: {} for name in models}
    return out
