"""The figures `strata diagnose` analyses: every service found through Redis, its /metrics read
for the window (`?since=`, shared.metrics_history), turned into services.control.diagnose's
dataclasses.

Engines are in the replica registry (with their /metrics URL, load and revision); gateways and
schedulers register themselves under `strata:service:<kind>:<id>`; a gateway can also be named
by URL. Deployments managed by control (shared.deployments) give the revisions serving, the
routing policy and the replica bounds.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from services.control.diagnose import DeploymentFigures, EngineFigures, Figures, ServiceFigures
from shared import deployments, keys, registry
from shared.layers import LAYER_NAMES
from shared.metrics_history import WINDOW_HEADER
from shared.store import connect_redis


class Samples:
    """One scrape's samples, summed by name and labels."""

    def __init__(self, text: str, window_s: float):
        self.window_s = window_s
        self.rows = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    def total(self, name: str, **match: str) -> float:
        return sum(v for n, labels, v in self.rows
                   if n == name and all(labels.get(k) == want for k, want in match.items()))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, labels, v in self.rows:
            if n == name and label in labels and all(labels.get(k) == want for k, want in match.items()):
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out


async def scrape(http: aiohttp.ClientSession, url: str, since: float) -> Samples | None:
    try:
        async with http.get(f"{url}/metrics", params={"since": str(since)}) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
            return Samples(text, float(resp.headers.get(WINDOW_HEADER, "0")))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def _registered(redis_url: str) -> tuple[dict, dict, dict, dict]:
    """(engines: replica -> fields, services: kind -> {instance: fields}, deployment settings,
    deployment history events)."""
    redis = connect_redis(redis_url, "strata-diagnose")
    try:
        engines: dict[str, dict[str, str]] = {}
        models = await registry.models(redis)
        for model in models:
            for replica in sorted(m.decode() for m in await redis.smembers(keys.model_replicas(model))):
                entry = await redis.hgetall(keys.replica(replica))
                if entry:
                    engines[replica] = {k.decode(): v.decode() for k, v in entry.items()}
        services = {kind: await registry.services(redis, kind)
                    for kind in ("gateway", "scheduler", "scaler", "control")}
        settings, events = {}, {}
        for name in await deployments.list_names(redis):
            events[name] = await deployments.history(redis, name)
            d = await deployments.load(redis, name)
            if d is not None:
                s = d.state
                settings[name] = {"stable": str(s.stable), "routing_policy": s.routing_policy,
                                  "min_replicas": str(d.stable_spec.replicas.min),
                                  "max_replicas": str(d.stable_spec.replicas.max)}
                if s.canary:
                    settings[name].update(canary=str(s.canary), canary_weight=f"{s.canary_weight}%")
        return engines, services, settings, events
    finally:
        await redis.aclose()


def _engine(replica: str, fields: dict[str, str], s: Samples | None) -> EngineFigures:
    deployment = fields.get("deployment") or fields.get("model", "")
    revision = fields.get("revision", "0")
    e = EngineFigures(replica, deployment, revision="" if revision == "0" else revision,
                      state=fields.get("state", "?") if s is not None else "unreachable",
                      max_num_seqs=int(float(fields.get("max_num_seqs", 64))))
    if s is None:
        return e
    m = {"model_name": deployment, "replica": replica}
    reasons = s.by("strata:request_success_total", "finished_reason", **m)
    e.window_s = s.window_s
    e.running = s.total("strata:num_requests_running", **m)
    e.waiting = s.total("strata:num_requests_waiting", **m)
    e.kv_usage = s.total("strata:kv_cache_usage_perc", **m)
    e.requests = sum(reasons.values())
    e.errors = reasons.get("error", 0.0)
    e.busy_s = s.total("strata:e2e_request_latency_seconds_sum", **m)
    e.itl_sum = s.total("strata:inter_token_latency_seconds_sum", **m)
    e.itl_count = s.total("strata:inter_token_latency_seconds_count", **m)
    e.prefix_queries = s.total("strata:prefix_cache_queries_total", **m)
    e.prefix_hits = s.total("strata:prefix_cache_hits_total", **m)
    e.preemptions = s.total("strata:num_preemptions_total", **m)
    e.cold_start_wait_s = s.total("strata:cold_start_wait_seconds_total", **m)
    e.steps = s.total("strata:engine_step_duration_seconds_count", **m)
    e.step_phases = s.by("strata:engine_step_seconds_sum", "phase", **m)
    return e


def _deployment(name: str, settings: dict[str, str], gateways: list[Samples], schedulers: list[Samples],
                replicas: list[EngineFigures]) -> DeploymentFigures:
    m = {"model_name": name}
    d = DeploymentFigures(name, settings=settings, replicas=replicas)
    for g in gateways:
        d.requests += g.total("strata:gateway_e2e_request_latency_seconds_count", **m)
        d.e2e_sum += g.total("strata:gateway_e2e_request_latency_seconds_sum", **m)
        d.ttft_sum += g.total("strata:gateway_time_to_first_token_seconds_sum", **m)
        for layer in LAYER_NAMES:
            d.layers[layer] = d.layers.get(layer, 0.0) + g.total("strata:request_layer_seconds_sum", layer=layer, **m)
    policies: dict[str, float] = {}
    for s in schedulers:
        d.queued += s.total("strata:scheduler_queue_wait_seconds_count", **m)
        d.queue_wait_sum += s.total("strata:scheduler_queue_wait_seconds_sum", **m)
        d.queue_depth += s.total("strata:scheduler_queue_depth", **m)
        d.matched_sum += s.total("strata:scheduler_matched_prefix_fraction_sum", **m)
        d.reachable_sum += s.total("strata:scheduler_reachable_prefix_fraction_sum", **m)
        d.lookups += s.total("strata:scheduler_reachable_prefix_fraction_count", **m)
        for policy, n in s.by("strata:scheduler_decisions_total", "policy", outcome="routed", **m).items():
            policies[policy] = policies.get(policy, 0.0) + n
    d.policy = max(policies, key=policies.get) if policies else settings.get("routing_policy", "")
    return d


async def gather(redis_url: str, since: float, gateway_urls: list[str] | None = None,
                 timeout: float = 3.0) -> Figures:
    engines, services, settings, events = await _registered(redis_url)
    for i, url in enumerate(gateway_urls or []):
        if url not in {f.get("http_url") for f in services["gateway"].values()}:
            services["gateway"][f"given-{i}"] = {"http_url": url}
    urls = {f["http_url"] for f in engines.values() if f.get("http_url")}
    urls |= {f["http_url"] for kind in services.values() for f in kind.values() if f.get("http_url")}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        scraped = dict(zip(urls, await asyncio.gather(*(scrape(http, u, since) for u in urls))))

    def samples(kind: str) -> list[Samples]:
        found = (scraped.get(f.get("http_url", "")) for f in services[kind].values())
        return [s for s in found if s is not None]

    gateways, schedulers = samples("gateway"), samples("scheduler")
    replicas = [_engine(r, f, scraped.get(f.get("http_url", ""))) for r, f in sorted(engines.items())]
    names = sorted({r.deployment for r in replicas} | set(settings))
    deployments = [_deployment(n, settings.get(n, {}), gateways, schedulers,
                               [r for r in replicas if r.deployment == n]) for n in names]
    window = max((s.window_s for s in scraped.values() if s is not None), default=since)
    now = time.time()
    for d in deployments:
        d.window_s, d.now = window, now
        d.events = [e for e in events.get(d.name, []) if e.get("at", 0) >= now - window]
    service_figures = []
    for kind, instances in services.items():
        for instance, fields in sorted(instances.items()):
            s = scraped.get(fields.get("http_url", ""))
            detail = ""
            if s is not None and kind == "gateway":
                detail = f"{s.total('strata:gateway_active_requests'):.0f} active requests"
            elif s is not None and kind == "scheduler":
                detail = f"admission queue {s.total('strata:scheduler_queue_depth'):.0f}"
            service_figures.append(ServiceFigures(kind, instance, fields.get("http_url", ""), s is not None, detail))
    windows = [s.window_s for s in scraped.values() if s is not None]
    return Figures(max(windows, default=since), deployments, service_figures)
