"""The gateway: OpenAI-compatible HTTP + SSE in front of the bus.

A request is authenticated and rate limited (Redis, shared by all gateway replicas), tokenized
(chat template included), checked against the limits its model's replicas advertise, and
published to the schedulers; its token stream arrives on this gateway's inbox straight from the
engine, in one TokenChunkBatch per engine step for all of this gateway's requests (`batch_to`),
or chunk by chunk on the request's own subject. Each request's state is one Flow
(services.gateway.flow), opened and closed once. Errors before the first byte carry their HTTP
status; after it, an in-band `data: {"error": ...}` event ends the stream. A client that goes
away cancels its request down to the engine. A stream whose engine replica dies continues on
another one from the tokens already sent (services.gateway.migration).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
from aiohttp import web
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.gateway import choices
from services.gateway import openai_api as oa
from services.gateway import request_fields, tools, tracing, utility_api
from services.gateway.admission import InflightLimit
from services.gateway.auth import ApiKey, KeyStore
from services.gateway.flow import Flow, FlowTable
from services.gateway.limits import AdvertisedLimits, ModelLimits
from services.gateway.lora import AdapterCatalog, LoraApi
from services.gateway.migration import Migrator
from services.gateway.openai_api import ApiError, ParsedRequest, error_response
from services.gateway.openapi import openapi_spec
from services.gateway.prompt_logprobs import PromptParts
from services.gateway.replica_info import replica_precision
from shared import http, http_limits, protocol, registry
from shared.bus import Bus, NatsAuth
from shared.deployments import Deployment, DeploymentWatcher
from shared.http_limits import ClientGone, ConnectionGuard, HttpLimits
from shared.layers import COMPONENT, LAYER_NAMES
from shared.logging import get_logger
from shared.metrics_history import MetricsHistory, metrics_response
from shared.protocol import (Cancel, ErrorCode, ErrorInfo, ErrorReply, GatewayStats, GenerateAck, GenerateRequest,
                             Heartbeat, KeyRevoked, LatencySample, RevisionOutcomes, SchedulerStats, TokenChunk,
                             TokenChunkBatch)
from shared.store import connect_redis

log = get_logger()


@dataclass
class GatewayConfig:
    nats_url: str
    redis_url: str
    models: list[str]  # model directories; served under their directory names unless named
    served_names: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    gateway_id: str = "gateway"
    require_auth: bool = True
    request_timeout: float = 600.0  # default deadline; headers Strata-Timeout / Strata-Deadline shorten it
    scheduler_ack_timeout: float = 2.0
    region: str = ""  # stamped on every request: schedulers prefer replicas in the caller's region
    scheduler_wait: float = 10.0  # no scheduler answers (this gateway or they just started): retry this long
    max_inflight: int = 256  # requests served at once; past it: 503 with Retry-After, before any work
    default_max_tokens: int = 1024  # chat requests without max_tokens (a deployment's limits override it)
    # Served name -> tool call parser (services.gateway.tool_parsers) of the models given here;
    # "" names every one of them. A deployment's own comes from its spec.
    tool_call_parsers: dict[str, str] = field(default_factory=dict)
    max_n: int = choices.MAX_N_DEFAULT  # choices per prompt (n, best_of); more is a 400
    http: HttpLimits = field(default_factory=HttpLimits)
    nats_auth: NatsAuth = field(default_factory=NatsAuth)


@dataclass
class ServedModel:
    name: str
    path: Path
    tokenizer: object
    max_model_len: int
    vocab_size: int
    created: int
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls with it

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def visible_text(self, token_id: int) -> str:
        """What a token adds to a completion's text (special tokens are skipped): text_offset."""
        return self.tokenizer.decode([token_id], skip_special_tokens=True)

    def decode_text(self, ids: list[int]) -> str:
        """A token-id prompt as echoed."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def configured_limits(self) -> ModelLimits:
        """What its config.json says (replicas may advertise smaller: services.gateway.limits)."""
        return ModelLimits(self.max_model_len, self.vocab_size)


def load_served_model(name: str, path: str, tool_call_parser: str | None = None) -> ServedModel:
    from transformers import AutoTokenizer

    config = json.loads((Path(path) / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return ServedModel(name, Path(path), tokenizer, int(config.get("max_position_embeddings", 2048)),
                       int(config["vocab_size"]), int(time.time()), tool_call_parser)


MAX_UNKNOWN_FIELD_NAMES = 256  # distinct names counted (and logged) by name: clients choose them
OTHER_FIELDS = "_other"


class GatewayMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("strata:gateway_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("strata:gateway_time_to_first_token_seconds", "HTTP arrival to the first token.",
                              ["model_name"], registry=r)
        self.e2e = Histogram("strata:gateway_e2e_request_latency_seconds", "HTTP arrival to the final token.",
                             ["model_name"], registry=r)
        self.active = Gauge("strata:gateway_active_requests", "Requests being served.", registry=r)
        self.layers = Histogram("strata:request_layer_seconds",
                                "Time of each request in each layer (shared.layers); component is the design's "
                                "layer owning it.", ["model_name", "layer", "component"],
                                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                         5.0, 10.0, 30.0, 60.0), registry=r)
        self.cancels = Counter("strata:gateway_cancelled_requests",
                               "Requests the gateway cancelled downstream (client left, or the stream broke).",
                               registry=r)
        self.refused = Counter("strata:gateway_refused_requests",
                               "Requests refused before any work, by reason (inflight: the in-flight limit).",
                               ["reason"], registry=r)
        self.http_refusals = Counter("strata:gateway_http_refusals",
                                     "Connections closed or refused by the HTTP limits, by reason (header_timeout, "
                                     "body_timeout, write_timeout, connection_limit).", ["reason"], registry=r)
        self.connections = Gauge("strata:gateway_open_connections", "Open HTTP connections.", registry=r)
        self.store_losses = Gauge("strata:gateway_store_data_losses",
                                  "Times the key store was found to have lost its data (the keys this gateway "
                                  "knew were written back).", registry=r)
        self.scheduler_verdicts = Counter("strata:gateway_scheduler_dead_verdicts",
                                          "Requests failed because the scheduler holding them fell silent.",
                                          registry=r)
        self.unknown_fields = Counter("strata:gateway_unknown_request_fields",
                                      "Request fields the endpoint does not know, refused with a 400 (as OpenAI's "
                                      f"API does), by endpoint and field name (past {MAX_UNKNOWN_FIELD_NAMES} "
                                      f"names: {OTHER_FIELDS!r}).", ["endpoint", "field"], registry=r)


class GatewayService:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.models: dict[str, ServedModel] = {}  # served name -> model (static ones, then deployments)
        self.aliases: dict[str, str] = {}  # alias -> served name (deployment aliases)
        self._static: set[str] = set()
        self.deployments: DeploymentWatcher | None = None
        self.metrics = GatewayMetrics()
        self.history = MetricsHistory(self.metrics.registry)
        self.bus: Bus | None = None
        self.redis = None
        self.keys: KeyStore | None = None
        self.flows = FlowTable()  # the engine requests being served, each from open to close
        # Where its requests' streams come: `<inbox>.<request id>` per chunk, `<inbox>` itself for
        # TokenChunkBatches (GenerateRequest.batch_to); under its connection's inbox prefix.
        self._inbox = ""
        self._schedulers_seen: dict[str, float] = {}
        self.limits = AdvertisedLimits()  # what each model's replicas say they take
        self._background: set[asyncio.Task] = set()
        self.scheduler_dead_after = 3.0
        self._runner: web.AppRunner | None = None
        self.url = ""
        self._report = GatewayStats(gateway_id=cfg.gateway_id)  # accumulates until published
        self._samples_seen: dict[str, int] = {}  # model -> revision samples offered to this report
        self._report_started = time.monotonic()
        self.migration = Migrator(self.flows, self._submit_leg, self.metrics.registry)
        self.inflight = InflightLimit(cfg.max_inflight)
        self._refused_unlogged, self._refusals_logged_at = 0, 0.0
        self.http_guard = ConnectionGuard(cfg.http, lambda reason: self.metrics.http_refusals.labels(reason).inc())
        self.metrics.connections.set_function(lambda: self.http_guard.open)
        self._listener: asyncio.AbstractServer | None = None
        self._unknown_fields_seen: set[str] = set()  # logged once each

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        structlog.contextvars.bind_contextvars(gateway_id=self.cfg.gateway_id)
        loop = asyncio.get_running_loop()
        names = self.cfg.served_names or [protocol.served_model_name(p) for p in self.cfg.models]
        parsers = self.cfg.tool_call_parsers
        for name, path in zip(names, self.cfg.models):
            self.models[name] = await loop.run_in_executor(None, load_served_model, name, path,
                                                           parsers.get(name, parsers.get("")))
        self._static = set(self.models)
        self.bus = await Bus.connect(self.cfg.nats_url, f"gateway-{self.cfg.gateway_id}", auth=self.cfg.nats_auth)
        self._inbox = f"{self.bus.inbox_prefix}.gw.{self.cfg.gateway_id}.{uuid.uuid4().hex[:8]}"
        self.redis = connect_redis(self.cfg.redis_url, f"gateway-{self.cfg.gateway_id}")
        self.keys = KeyStore(self.redis)
        self.metrics.store_losses.set_function(lambda: self.keys.losses)
        self.adapters = AdapterCatalog(self.redis, lambda: self.models)  # before deployments: it serves theirs
        self.deployments = DeploymentWatcher(self.redis, self._on_deployment_change)
        self.lora_api = LoraApi(self.adapters, self.bus, self._authenticate, self.deployments, self._read_json)
        await self.deployments.start(self.bus)
        await self.bus.subscribe(protocol.LORA_ADAPTERS_ALL, protocol.LoraAdaptersChanged, self.adapters.on_change)
        await self.adapters.refresh_all()
        await self.bus.nc.subscribe(f"{self._inbox}.*", cb=self._on_chunk)
        await self.bus.nc.subscribe(self.batch_subject, cb=self._on_batch)
        await self.bus.nc.subscribe(protocol.accepted(f"{self._inbox}.*"), cb=self._on_accepted)
        heartbeats = await self.bus.subscribe(protocol.HEARTBEAT_ALL, Heartbeat, self._on_heartbeat)
        self._stats_sub = await self.bus.subscribe(protocol.SCHEDULER_STATS_ALL, SchedulerStats,
                                                   self._on_scheduler_stats)
        await self.bus.subscribe(protocol.CONTROL_KEYS, KeyRevoked, self._on_key_revoked)
        self._watchdog = asyncio.create_task(self._watch_schedulers())
        self.migration.start(self.bus, heartbeats)
        self._reporter = asyncio.create_task(self._report_loop())
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                     **self.cfg.http.runner_kwargs())
        await self._runner.setup()
        self._listener = await http_limits.serve(self._runner, self.http_guard, self.cfg.host, self.cfg.port)
        port = self._listener.sockets[0].getsockname()[1]
        self.url = http.advertised_url(self.cfg.host, port)
        self._observers = [asyncio.create_task(self.history.run()), asyncio.create_task(registry.keep_announced(
            self.redis, "gateway", self.cfg.gateway_id, {"http_url": self.url})),
            asyncio.create_task(self.keys.watch()), asyncio.create_task(self._adapters_resync())]
        log.info("gateway ready", url=self.url, models=list(self.models))

    async def stop(self) -> None:
        self._watchdog.cancel()
        for task in self._observers:
            task.cancel()
        self._reporter.cancel()
        self.migration.stop()
        self.deployments.stop()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.bus.close()
        await self.redis.aclose()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.http_guard.middleware, self._admission_middleware,
                                           tracing.trace_requests, self._errors_middleware],
                              client_max_size=4 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{name}", self.retrieve_model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        return app

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self.lora_api.load(request)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self.lora_api.unload(request)

    async def _adapters_resync(self, interval: float = 5.0) -> None:
        """Heals a lost adapter announcement."""
        while True:
            await asyncio.sleep(interval)
            await self.adapters.refresh_all()

    async def _on_deployment_change(self, name: str, deployment: Deployment | None) -> None:
        """Serve a deployment under its name and aliases (the stable revision's tokenizer)."""
        for alias in [a for a, target in self.aliases.items() if target == name]:
            del self.aliases[alias]
        if deployment is None:
            if name not in self._static:
                self.models.pop(name, None)
            log.info("deployment removed", deployment=name)
            return
        spec = deployment.stable_spec
        current = self.models.get(name)
        if current is None or current.path != Path(spec.model):
            try:
                self.models[name] = await asyncio.get_running_loop().run_in_executor(
                    None, load_served_model, name, spec.model, spec.tool_call_parser or None)
            except Exception as exc:  # keep serving what we had; control validated the spec
                log.error("cannot load the deployment's tokenizer", deployment=name, error=str(exc))
                return
        else:
            current.tool_call_parser = spec.tool_call_parser or None
        for alias in spec.aliases:
            if alias not in self.models:
                self.aliases[alias] = name
        await self.adapters.refresh(name)
        log.info("deployment served", deployment=name, aliases=spec.aliases, revision=deployment.state.stable)

    # ---- plumbing ---------------------------------------------------------------------------
    @property
    def batch_subject(self) -> str:
        """Where engines send this gateway's TokenChunkBatches (GenerateRequest.batch_to)."""
        return self._inbox

    async def _on_chunk(self, msg) -> None:
        """A chunk of one request, alone on its reply subject `<inbox>.<request id>`."""
        rid = msg.subject.rsplit(".", 1)[1]
        flow = self.flows.get(rid)
        if flow is None:
            return  # a late chunk of a request already ended
        try:
            chunk = protocol.decode(TokenChunk, msg.data)
        except protocol.ProtocolError as exc:
            log.warning("malformed chunk", request_id=rid, error=str(exc))
            return
        self._deliver(flow, chunk)

    async def _on_batch(self, msg) -> None:
        """An engine step's chunks for this gateway (on `batch_to`): each goes to its flow exactly
        as if it had come alone."""
        try:
            batch = protocol.decode(TokenChunkBatch, msg.data)
        except protocol.ProtocolError as exc:
            log.warning("malformed chunk batch", error=str(exc))
            return
        for chunk in batch.chunks:
            flow = self.flows.of_leg(chunk.request_id)
            if flow is None:
                continue  # a late chunk of a request already ended
            if chunk.replica_id is None:
                chunk.replica_id = batch.replica_id
            self._deliver(flow, chunk)

    @staticmethod
    def _deliver(flow: Flow, chunk: TokenChunk) -> None:
        if chunk.is_final and chunk.timestamps is not None:
            chunk.timestamps["gateway_final_received"] = time.time()
        flow.queue.put_nowait(chunk)

    async def _on_accepted(self, msg) -> None:
        """An engine took the request: its scheduler's fate no longer matters to it."""
        flow = self.flows.get(msg.subject.rsplit(".", 2)[1])
        if flow is not None:
            self.migration.on_accepted(flow, msg.data)

    async def _on_heartbeat(self, hb: Heartbeat, _raw) -> None:
        now = time.monotonic()
        self.migration.on_heartbeat(hb, now)
        self.limits.note(hb, now)

    def model_limits(self, model: ServedModel) -> ModelLimits:
        """The limits a request for the model is checked against: its replicas' (services.gateway.limits)."""
        return self.limits.of(model.name, model.configured_limits, time.monotonic())

    def _spawn_cancel(self, flow: Flow) -> None:
        if not flow.leg_id:  # between two legs: the migration cancels them
            return
        task = asyncio.create_task(self.bus.publish(protocol.CANCEL, Cancel(request_id=flow.leg_id,
                                                                              tenant=flow.tenant)))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _on_scheduler_stats(self, stats: SchedulerStats, _raw) -> None:
        self._schedulers_seen[stats.scheduler_id] = time.monotonic()

    async def _on_key_revoked(self, msg: KeyRevoked, _raw) -> None:
        self.keys.forget(msg.key_hash)
        log.info("api key revoked", key_id=msg.key_hash[:12])

    async def _watch_schedulers(self) -> None:
        """A request held by a scheduler that died (no stats for a while) and not yet started
        ends with an error instead of silence until its deadline. Not while this loop runs late
        or the stats wait unread: then the silence is this gateway's."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            late, last = now - last > 0.5 + 1.0, now
            if late or self._stats_sub.pending_msgs > 0:
                for scheduler_id in self._schedulers_seen:  # judged afresh from now on
                    self._schedulers_seen[scheduler_id] = now
                continue
            for flow in self.flows:
                seen = self._schedulers_seen.get(flow.held_by) if flow.held_by is not None else None
                if seen is not None and now - seen > self.scheduler_dead_after:
                    self.metrics.scheduler_verdicts.inc()
                    scheduler_id, flow.held_by = flow.held_by, None
                    # In case an engine does have it after all: it must not run for nobody.
                    self._spawn_cancel(flow)
                    flow.queue.put_nowait(TokenChunk(request_id=flow.request_id, seq=-1, finish_reason="error",
                                                     error=ErrorInfo(code=ErrorCode.UNAVAILABLE, message=(
                                                         f"scheduler {scheduler_id} holding the request died"))))

    def _account(self, model: str, timings: dict[str, float] | None, revision: int | None = None,
                 sample: LatencySample | None = None) -> None:
        """Count a finished request (timings) or a failed one (None) in the next report; one of
        a managed revision also by revision, with its latency sample (canary analysis)."""
        if revision:
            outcome = self._report.outcomes.setdefault(model, {}).setdefault(revision, RevisionOutcomes())
            outcome.requests += 1
            outcome.errors += timings is None
        if sample is not None:  # reservoir sampling: an unbiased subsample when there are too many
            kept = self._report.samples.setdefault(model, [])
            seen = self._samples_seen[model] = self._samples_seen.get(model, 0) + 1
            if len(kept) < protocol.MAX_LATENCY_SAMPLES:
                kept.append(sample)
            elif (slot := random.randrange(seen)) < protocol.MAX_LATENCY_SAMPLES:
                kept[slot] = sample
        if timings is None:
            self._report.failed[model] = self._report.failed.get(model, 0) + 1
            return
        self._report.completed[model] = self._report.completed.get(model, 0) + 1
        layers = self._report.layer_seconds.setdefault(model, {})
        for layer, seconds in timings.items():
            layers[layer] = layers.get(layer, 0.0) + seconds

    async def _report_loop(self, interval: float = 2.0) -> None:
        while True:
            await asyncio.sleep(interval)
            report, self._report = self._report, GatewayStats(gateway_id=self.cfg.gateway_id)
            self._samples_seen.clear()
            now = time.monotonic()
            report.http_url, report.timestamp = self.url, time.time()
            report.interval_s, self._report_started = now - self._report_started, now
            try:
                await self.bus.publish(protocol.gateway_stats(self.cfg.gateway_id), report)
            except Exception as exc:
                log.warning("stats publish failed", error=str(exc))

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"  # bounded label values
        try:
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc)
        except ClientGone as exc:
            if exc.status == 499:  # it left (mid-body, or stopped reading its stream): nobody to answer
                self.metrics.requests.labels(endpoint, "499").inc()
                raise asyncio.CancelledError(str(exc)) from None
            response = error_response(ApiError(exc.status, str(exc), "invalid_request_error", None,
                                               "request_timeout"))  # too slow sending its body
            response.force_close()
        except web.HTTPException as exc:  # routing errors, body too large, ...
            if exc.status < 400:
                raise
            response = error_response(ApiError(exc.status, exc.reason or "error",
                                               "invalid_request_error", None, None))
        except asyncio.CancelledError:
            self.metrics.requests.labels(endpoint, "499").inc()
            raise
        except Exception:
            log.exception("unhandled error", path=endpoint)
            response = error_response(ApiError(500, "internal error", "server_error"))
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    async def _authenticate(self, request: web.Request) -> ApiKey:
        if not self.cfg.require_auth:
            return ApiKey("", "anonymous", 0, 0)
        return await self.keys.authenticate(request.headers.get("Authorization", ""))

    # ---- simple routes ----------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        connected = self.bus is not None and self.bus.nc.is_connected
        return web.json_response({"status": "ok" if connected else "degraded", "models": list(self.models)},
                                 status=200 if connected else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return metrics_response(request, self.metrics.registry, self.history)

    async def openapi(self, request: web.Request) -> web.Response:
        await self._authenticate(request)
        return web.json_response(openapi_spec(self.url))

    async def list_models(self, request: web.Request) -> web.Response:
        await self._authenticate(request)
        return web.json_response({"object": "list", "data": await self._model_cards()})

    async def _model_cards(self) -> list[dict]:
        """/v1/models entries: served models, deployment aliases (parent: the model they name), adapters."""
        replicas = await replica_precision(self.redis, list(self.models))  # each replica's quantization
        return [utility_api.model_card(m.name, m.created, str(m.path), None, self.model_limits(m).max_model_len,
                                       **replicas[m.name]) for m in self.models.values()] + [
            utility_api.model_card(alias, self.models[target].created, str(self.models[target].path), target,
                                   self.model_limits(self.models[target]).max_model_len)
            for alias, target in self.aliases.items() if target in self.models] + self.adapters.model_entries(
            lambda m: self.model_limits(m).max_model_len)

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{name} (the SDK's models.retrieve)."""
        await self._authenticate(request)
        name = request.match_info["name"]
        card = next((c for c in await self._model_cards() if c["id"] == name), None)
        if card is None:
            raise utility_api.model_not_found(name)
        return web.json_response(card)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, lambda body, model: (
            utility_api.tokenize, body, model.tokenizer, self.model_limits(model).max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, lambda body, model: (
            utility_api.detokenize, body, model.tokenizer, self.model_limits(model).vocab_size))

    async def _tokenizer_route(self, request: web.Request, call) -> web.Response:
        """/tokenize and /detokenize: `call(body, model)` gives the pure function and its arguments."""
        await self._authenticate(request)
        raw = await self.http_guard.read_body(request)
        body = parse_json(raw)
        model = self._utility_model(utility_api.request_model(body))
        return web.json_response(await self._off_loop(len(raw), *call(body, model)))

    async def version(self, request: web.Request) -> web.Response:
        await self._authenticate(request)
        return web.json_response(utility_api.version())

    def _utility_model(self, name: str | None) -> ServedModel:
        """The model a /tokenize or /detokenize request names; unnamed: the only one served."""
        if name is not None:
            return self._model_and_adapter(name)[0]  # an adapter tokenizes as its base model
        if len(self.models) != 1:
            raise oa.bad(f"'model' is required: this gateway serves {len(self.models)} models", "model")
        return next(iter(self.models.values()))

    # ---- generation -------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, self._completion_prompt)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, self._chat_prompt)

    async def _generation(self, request: web.Request, prompt_of) -> web.StreamResponse:
        key = await self._authenticate(request)
        try:
            parsed, model, prompts, lora = await prompt_of(request)
        except oa.UnrecognizedFields as exc:
            self._count_unknown_fields(request.path, exc.fields)
            raise
        if parsed.user is not None:
            tracing.annotate_end_user(parsed.user)
        request_fields.check_token_ids(parsed.sampling, self.model_limits(model).vocab_size)
        return await self._serve(request, key, parsed, model, prompts, lora)

    def _count_unknown_fields(self, endpoint: str, names: list[str]) -> None:
        """Refused fields, counted by name and logged the first time each is seen (what clients
        send that this gateway does not take)."""
        for name in (n[:64] for n in names):  # label values bounded in length and (below) in number
            if name not in self._unknown_fields_seen:
                if len(self._unknown_fields_seen) >= MAX_UNKNOWN_FIELD_NAMES:
                    self.metrics.unknown_fields.labels(endpoint, OTHER_FIELDS).inc()
                    continue
                self._unknown_fields_seen.add(name)
                log.warning("unknown request field refused", endpoint=endpoint, field=name)
            self.metrics.unknown_fields.labels(endpoint, name).inc()

    @web.middleware
    async def _admission_middleware(self, request: web.Request, handler):
        """Generation requests within this gateway's in-flight limit. Past it, one is refused
        before anything else is done for it: no body read, no span, no log line of its own (a
        summary each second): under overload the cheapest answer is the one that does least."""
        if request.method != "POST" or request.path not in tracing.GENERATION_PATHS:
            return await handler(request)
        if not self.inflight.try_acquire():
            self.metrics.refused.labels("inflight").inc()
            self.metrics.requests.labels(request.path, "503").inc()
            self._note_refusal()
            return error_response(ApiError(
                503, f"this gateway is serving {self.inflight.limit} requests, its most; try again later",
                "overloaded_error", None, "overloaded", retry_after=self.inflight.retry_after()))
        try:
            return await handler(request)
        finally:
            self.inflight.release(time.monotonic())

    def _note_refusal(self) -> None:
        self._refused_unlogged += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= 1.0:
            log.warning("requests refused: in-flight limit", refused=self._refused_unlogged,
                        inflight=self.inflight.inflight, limit=self.inflight.limit)
            self._refused_unlogged, self._refusals_logged_at = 0, now

    async def _completion_prompt(self, request: web.Request
                                 ) -> tuple[ParsedRequest, "ServedModel", list[list[int]], str | None]:
        """The request, its model, the token ids of each prompt of its batch, its adapter."""
        parsed = oa.parse_completion(await self._read_json(request))
        model, lora = self._model_and_adapter(parsed.model)
        prompts, vocab_size = [], self.model_limits(model).vocab_size
        for text, ids in parsed.prompts:
            if ids is not None:
                bad = next((t for t in ids if not 0 <= t < vocab_size), None)
                if bad is not None:
                    raise oa.bad(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
            else:
                ids = await self._off_loop(len(text), model.tokenizer.encode, text)
            prompts.append(ids)
        return parsed, model, prompts, lora

    async def _chat_prompt(self, request: web.Request
                           ) -> tuple[ParsedRequest, "ServedModel", list[list[int]], str | None]:
        parsed, messages = oa.parse_chat(await self._read_json(request))
        model, lora = self._model_and_adapter(parsed.model)
        tools.bind_parser(parsed.tools, model.tool_call_parser)
        tools.check_template_renders_tools(parsed.tools, model.tokenizer.chat_template)

        def render() -> list[int]:
            text = model.tokenizer.apply_chat_template(messages, tools=parsed.tools.tools if parsed.tools else None,
                                                       tokenize=False, add_generation_prompt=True)
            return model.tokenizer.encode(text, add_special_tokens=False)

        try:
            ids = await self._off_loop(sum(len(m["content"]) for m in messages), render)
        except Exception as exc:
            raise oa.bad(f"messages cannot be rendered with this model's chat template: {exc}", "messages") from None
        if parsed.extra.get("max_tokens_unset"):  # bounded: never "the whole context" by default
            room = self.model_limits(model).max_model_len - len(ids)
            parsed.sampling.max_tokens = max(min(self.default_max_tokens(model.name), room), 1)
        return parsed, model, [ids], lora

    def default_max_tokens(self, model: str) -> int:
        """max_tokens of a chat request that gives none: its deployment's limit, else this gateway's."""
        deployment = self.deployments.deployments.get(model) if self.deployments is not None else None
        return deployment.stable_spec.limits.default_max_tokens if deployment else self.cfg.default_max_tokens

    async def _read_json(self, request: web.Request):
        return parse_json(await self.http_guard.read_body(request))

    @staticmethod
    async def _off_loop(size: int, fn, *args):
        """Tokenize small inputs inline (cheaper than a thread hop); large ones on a worker
        thread, so one huge prompt does not stall every stream this gateway serves."""
        if size < 16_384:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _model_and_adapter(self, name: str) -> tuple[ServedModel, str | None]:
        """The served model a request names, and its LoRA adapter ("base:adapter" or an adapter's name)."""
        found = self.models.get(name) or self.models.get(self.aliases.get(name, ""))
        if found is not None:
            return found, None
        resolved = self.adapters.resolve(name)
        if resolved is None:
            return self._model(name), None  # raises model_not_found
        base, adapter = resolved
        return self._model(base), adapter

    def _model(self, name: str) -> ServedModel:
        model = self.models.get(name) or self.models.get(self.aliases.get(name, ""))
        if model is None:  # echoed bounded: a client's megabyte of "model" is not sent back
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise ApiError(404, f"the model {shown!r} does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return model

    async def _serve(self, request: web.Request, key: ApiKey, parsed: ParsedRequest, model: ServedModel,
                     prompts: list[list[int]], lora: str | None = None) -> web.StreamResponse:
        """One engine request (a flow) per prompt, each asking for the request's choices per prompt
        (services.gateway.choices); their chunks make one response."""
        arrival = tracing.received_at()
        choices.check_limit(parsed.choices, self.cfg.max_n)
        max_model_len = self.model_limits(model).max_model_len
        for ids in prompts:
            if len(ids) + parsed.sampling.max_tokens > max_model_len:
                raise oa.bad(f"This model's maximum context length is {max_model_len} tokens. However, you "
                             f"requested {len(ids) + parsed.sampling.max_tokens} tokens ({len(ids)} in the prompt, "
                             f"{parsed.sampling.max_tokens} for the completion).",
                             "messages" if parsed.chat else "prompt", "context_length_exceeded")
        deadline = oa.request_deadline(request.headers, arrival, self.cfg.request_timeout)
        timeout = deadline - arrival
        per_prompt = parsed.choices.per_prompt
        charged = sum(len(ids) for ids in prompts) + len(prompts) * per_prompt * parsed.sampling.max_tokens
        charged_at = time.time()
        over = await self.keys.charge(key, charged) if self.cfg.require_auth else None
        if over is not None:
            what, retry_after = over
            raise ApiError(429, f"rate limit reached for {what} per minute", "rate_limit_error", None,
                           "rate_limit_exceeded", retry_after=retry_after)
        # best_of ranks choices by cumulative logprob: the engine sends the chosen tokens' ones.
        logprobs = parsed.sampling.logprobs
        if parsed.choices.selects and logprobs is None:
            logprobs = 0
        sampling = msgspec.structs.replace(parsed.sampling, n=per_prompt, logprobs=logprobs)
        flows: list[Flow] = []
        self.metrics.active.inc()
        try:
            for ids in prompts:  # all submitted before any is waited for: their prefills overlap
                flows.append(self._open_flow(key, model, ids, sampling, deadline, timeout, arrival, lora,
                                             parsed.stream))
                flows[-1].gen.timestamps["gateway_published"] = time.time()
                await self._submit_leg(flows[-1], flows[-1].gen)
            for flow in flows:
                flow.first = await flow.queue.get()
                flow.held_by = None
                if flow.first.error is not None:
                    flow.done = flow.first.replica_id is not None  # from the engine itself: nothing runs on
                    self._account(model.name, None, flow.first.revision)
                    raise oa.from_engine_error(flow.first.error.code, flow.first.error.message,
                                               flow.first.error.retry_after_s)
            first_at = time.time()
            self.metrics.ttft.labels(model.name).observe(first_at - arrival)
            if parsed.stream:
                return await self._stream(request, parsed, model, flows, (arrival, first_at))
            return await self._collect(parsed, model, flows, (arrival, first_at))
        finally:
            if self.cfg.require_auth:  # charge what was used, not the estimate
                used = sum(len(flow.ids) + flow.completion_tokens for flow in flows)
                task = asyncio.create_task(self.keys.settle(key, charged, used, charged_at))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            self.metrics.active.dec()
            for flow in flows:
                await self._close_flow(flow)

    def _open_flow(self, key: ApiKey, model: ServedModel, ids: list[int], sampling: protocol.SamplingParams,
                   deadline: float, timeout: float, arrival: float, lora: str | None, stream: bool) -> Flow:
        rid = uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=rid)
        gen = GenerateRequest(request_id=rid, model=model.name, reply_to=f"{self._inbox}.{rid}",
                              prompt_token_ids=ids, sampling=sampling, deadline=deadline,
                              tenant=key.tenant, priority=key.priority,
                              timestamps={"gateway_received": arrival}, region=self.cfg.region or None,
                              lora=lora, batch_to=self.batch_subject)
        tracing.annotate_request(gen, stream)
        flow = Flow(gen, asyncio.Queue())
        # The engine ends the request at its deadline; if even that final chunk never comes
        # (a lost message, a dead engine), this sentinel ends the wait.
        flow.timer = asyncio.get_running_loop().call_later(timeout + 2.0, flow.queue.put_nowait, TokenChunk(
            request_id=rid, seq=-1, finish_reason="error",
            error=ErrorInfo(code=ErrorCode.DEADLINE_EXCEEDED, message="timed out waiting for tokens")))
        self.flows.open(flow)
        return flow

    async def _submit_leg(self, flow: Flow, leg: GenerateRequest) -> None:
        """Hand a leg of the flow (its first, or a migration's) to a scheduler, which holds it
        until an engine takes it."""
        scheduler_id = await self._submit(leg)
        if not flow.at_engine and not flow.closed and leg.request_id == flow.leg_id:
            flow.held_by = scheduler_id

    async def _close_flow(self, flow: Flow) -> None:
        leg_id = self.flows.close(flow)
        if not flow.done:  # the client left, or something broke: free the engine's blocks now
            self.metrics.cancels.inc()
            await asyncio.shield(self._cancel(flow, leg_id))

    async def _submit(self, gen: GenerateRequest) -> str:
        """Hand the request to a scheduler; returns the id of the scheduler that took it."""
        # No scheduler subscribed (they are starting, or restarting): nothing holds the request,
        # so it is offered again for a while. A timeout is different: one may hold it.
        give_up = time.monotonic() + max(min(self.cfg.scheduler_wait, gen.deadline - time.time()), 0.0)
        while True:
            try:
                reply = await self.bus.request(protocol.GENERATE, gen, timeout=self.cfg.scheduler_ack_timeout,
                                               headers={protocol.HEADER_REQUEST_ID: gen.request_id,
                                                        protocol.HEADER_DEADLINE: f"{gen.deadline:.3f}"})
                break
            except NoRespondersError:
                if time.monotonic() + 0.2 >= give_up:
                    raise ApiError(503, "no scheduler is available", "overloaded_error", None, "unavailable",
                                   retry_after=1.0) from None
                await asyncio.sleep(0.2)
            except (NatsTimeoutError, asyncio.TimeoutError):
                raise ApiError(503, "no scheduler is available", "overloaded_error", None, "unavailable",
                               retry_after=1.0) from None
        try:
            ack = protocol.decode(GenerateAck, reply.data)
        except protocol.ProtocolError as exc:
            try:  # the scheduler refused a message it could not take (shared.bus's ErrorReply)
                refused = protocol.decode(ErrorReply, reply.data).error
            except protocol.ProtocolError:
                raise ApiError(503, f"the scheduler answered unexpectedly: {exc}", "overloaded_error", None,
                               "unavailable", retry_after=1.0) from None
            raise oa.from_engine_error(refused.code, refused.message, refused.retry_after_s) from None
        if not ack.accepted:
            error = ack.error or protocol.ErrorInfo(code=ErrorCode.UNAVAILABLE, message="refused by the scheduler")
            raise oa.from_engine_error(error.code, error.message, error.retry_after_s)
        return ack.replica_id

    async def _cancel(self, flow: Flow, leg_id: str) -> None:
        if not leg_id:  # between two legs of a migrating stream: the migration cancels them
            return
        try:
            await self.bus.publish(protocol.CANCEL, Cancel(request_id=leg_id, tenant=flow.tenant))
        except Exception as exc:
            log.warning("cancel publish failed", error=str(exc))

    async def _chunks(self, flow: Flow):
        """The flow's stream: its current engine run's chunks in order, and nothing else (a request
        must never interleave two engines' tokens). A request whose replica dies, or whose stream
        loses a chunk, continues on another replica (services.gateway.migration)."""
        chunk = flow.first
        while True:
            delivered = self.migration.accept(flow, chunk)
            if delivered is not None:
                if delivered.is_final:
                    flow.done = True
                yield delivered
                if delivered.is_final:
                    return
            chunk = await flow.queue.get()

    async def _merged(self, flows: list[Flow]):
        """(prompt number, chunk) of every flow as they come, until each flow's final chunk."""
        if len(flows) == 1:
            async for chunk in self._chunks(flows[0]):
                yield 0, chunk
            return
        merged: asyncio.Queue[tuple[int, TokenChunk]] = asyncio.Queue()

        async def pump(prompt_no: int, flow: Flow) -> None:
            try:
                async for chunk in self._chunks(flow):
                    merged.put_nowait((prompt_no, chunk))
            except Exception as exc:  # the response still ends, with one error
                log.exception("stream failed", request_id=flow.gen.request_id)
                merged.put_nowait((prompt_no, TokenChunk(request_id=flow.gen.request_id, seq=-1, finish_reason="error",
                                                         error=ErrorInfo(code=ErrorCode.INTERNAL, message=str(exc)))))

        tasks = [asyncio.create_task(pump(i, flow)) for i, flow in enumerate(flows)]
        try:
            running = len(flows)
            while running:
                prompt_no, chunk = await merged.get()
                running -= chunk.is_final
                yield prompt_no, chunk
        finally:
            for task in tasks:
                task.cancel()

    async def _collect(self, parsed: ParsedRequest, model: ServedModel, flows: list[Flow],
                       times: tuple[float, float]) -> web.Response:
        arrival, first_at = times
        n = parsed.choices.n
        bodies, finals = [], []
        created = oa.now()
        rid = flows[0].gen.request_id
        parts, first_chunks = self._prompt_parts(parsed, model, flows), []
        for prompt_no, flow in enumerate(flows):  # each flow's chunks wait in its queue meanwhile
            chunks = []
            async for chunk in self._chunks(flow):
                if chunk.error is not None:
                    self._account(model.name, None, chunk.revision)
                    raise oa.from_engine_error(chunk.error.code, chunk.error.message, chunk.error.retry_after_s)
                chunks.append(chunk)
            finals.append(chunks[-1])
            first_chunks.append(chunks[0])
            for chunk in chunks:
                parts.note(prompt_no, chunk)
            grouped = choices.by_choice(chunks)
            picked = choices.best(grouped, n) if parsed.choices.selects else list(grouped.values())
            for k, choice_chunks in enumerate(picked):
                if parsed.choices.selects and parsed.sampling.logprobs is None:  # asked for ranking only
                    choice_chunks = [msgspec.structs.replace(c, logprobs=None) for c in choice_chunks]
                last = next(c for c in reversed(choice_chunks) if c.finish_reason is not None)
                index = choices.response_index(prompt_no, k, n)
                if parsed.chat:
                    body = oa.chat_body(f"chatcmpl-{rid}", model.name, created, "".join(c.text for c in choice_chunks),
                                        last.finish_reason,
                                        oa.logprobs_chat(choice_chunks, model.decode_token, parsed.logprobs or 0), None)
                    if parsed.tools is not None:
                        tools.reply_choice(body["choices"][0], parsed.tools, body["choices"][0]["message"]["content"])
                else:  # the prompt's parts (echo, prompt logprobs) come first
                    text, logprobs, vllm_prompt_logprobs = parts.completion(prompt_no, index, choice_chunks)
                    body = oa.completion_body(f"cmpl-{rid}", model.name, created, text, last.finish_reason, logprobs,
                                              None, chunk=False, vllm_prompt_logprobs=vllm_prompt_logprobs)
                bodies.append((index, body))
        body = choices.merge_bodies(bodies)
        if parsed.chat:  # vLLM's place for prompt_logprobs in a chat response
            body.update(parts.chat_fields(0, first_chunks[0]))
        body["usage"] = oa.usage_dict(TokenChunk(request_id=rid, seq=0, usage=choices.total_usage(finals)))
        extensions = [self._finished(body["id"], model, flow.gen, final, first_at)
                      for flow, final in zip(flows, finals)]
        body["strata"] = extensions[0]
        self.metrics.e2e.labels(model.name).observe(time.time() - arrival)
        return web.json_response(body, headers={"x-request-id": rid,
                                                "x-strata-timings": json.dumps(extensions[0]["timings"])})

    @staticmethod
    def _prompt_parts(parsed: ParsedRequest, model: ServedModel, flows: list[Flow]) -> PromptParts:
        texts = [text for text, _ in parsed.prompts] or [None] * len(flows)  # chat: the rendered template's ids
        return PromptParts(parsed.prompt, parsed.logprobs if not parsed.chat else None,
                           [(text, flow.ids) for text, flow in zip(texts, flows)], model)

    def _finished(self, response_id: str, model: ServedModel, gen: GenerateRequest, final: TokenChunk,
                  first_at: float) -> dict:
        """The strata extension of a finished request; its layer timings also go to the layer
        histogram, the next GatewayStats report, the request's span and its log line."""
        done = time.time()
        extension = oa.strata_extension(final, done)
        timings = extension["timings"]
        for name in LAYER_NAMES:
            self.metrics.layers.labels(model.name, name, COMPONENT[name]).observe(timings[name])
        sample = None
        if final.revision:
            tokens = final.usage.completion_tokens if final.usage else len(final.token_ids)
            sample = LatencySample(revision=final.revision, finished_at=done,
                                   ttft_s=first_at - gen.timestamps["gateway_received"],
                                   itl_s=(done - first_at) / (tokens - 1) if tokens > 1 else 0.0, output_tokens=tokens)
        self._account(model.name, timings, final.revision, sample)
        tracing.annotate_response(response_id, model.name, final, first_at - gen.timestamps["gateway_received"],
                                  timings)
        return extension

    async def _stream(self, request: web.Request, parsed: ParsedRequest, model: ServedModel, flows: list[Flow],
                      times: tuple[float, float]) -> web.StreamResponse:
        arrival, first_at = times
        gen = flows[0].gen
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "x-request-id": gen.request_id})
        await response.prepare(request)
        created = oa.now()
        rid = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{gen.request_id}"
        usage_null = {"usage": None} if parsed.include_usage else {}
        n = parsed.choices.n
        prompt_tokens, completion_tokens = sum(len(flow.ids) for flow in flows), 0  # continuous usage stats

        async def send(obj: dict) -> None:
            try:
                async with self.http_guard.write_deadline():
                    await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
            except TimeoutError:  # a client that stopped reading must not hold its slot and blocks
                self.http_guard.count("write_timeout")
                if request.transport is not None:
                    request.transport.abort()
                raise ClientGone("the client stopped reading the stream", 499) from None

        tool_parsers: dict = {}  # chat with tools: each choice's tool call parser, by response index
        if parsed.chat:
            role_usage = {"usage": oa.running_usage(prompt_tokens, 0)} if parsed.continuous_usage else usage_null
            for index in range(len(flows) * n):
                await send({**choices.indexed(oa.chat_chunk(rid, model.name, created, {"role": "assistant", "content": ""},
                                                            None, None), index), **role_usage})
        finals, flows_open = [], len(flows)
        parts = self._prompt_parts(parsed, model, flows)
        async with contextlib.aclosing(self._merged(flows)) as stream:
            async for prompt_no, chunk in stream:
                if chunk.error is not None:  # after the first byte: in band, and the stream ends
                    self._account(model.name, None, chunk.revision)
                    await send(oa.from_engine_error(chunk.error.code, chunk.error.message).body())
                    await response.write_eof()
                    return response
                index = choices.response_index(prompt_no, chunk.index, n)
                extension = {}
                if chunk.is_final:
                    finals.append(chunk)
                    flows_open -= 1
                    extension = {"strata": self._finished(rid, model, flows[prompt_no].gen, chunk, first_at)}
                # The strata extension: on the usage chunk if asked, else on the last one.
                on_last = {} if parsed.include_usage or flows_open else extension
                choice_done = chunk.finish_reason is not None
                usage_now = usage_null
                if parsed.continuous_usage:  # stream_options.continuous_usage_stats: the usage so far, every chunk
                    completion_tokens += len(chunk.token_ids)
                    usage_now = {"usage": oa.running_usage(prompt_tokens, completion_tokens)}
                if parsed.chat:
                    logprobs = oa.logprobs_chat([chunk], model.decode_token, parsed.logprobs or 0)
                    deltas = [{"content": chunk.text} if chunk.text or not choice_done else {}]
                    finish = chunk.finish_reason
                    if parsed.tools is not None:  # content and tool calls, as the choice's parser reads them
                        if index not in tool_parsers:
                            tool_parsers[index] = parsed.tools.parser_for_reply()
                        if tool_parsers[index] is not None:
                            deltas, finish = tools.stream_deltas(tool_parsers[index], chunk.text, choice_done, finish,
                                                                 logprobs is not None)
                    prompt_fields = parts.chat_fields(prompt_no, chunk)  # vLLM's prompt_logprobs, once
                    if prompt_fields and not deltas:
                        deltas = [{}]
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        await send({**choices.indexed(oa.chat_chunk(rid, model.name, created, delta,
                                                                    finish if last else None,
                                                                    logprobs if i == 0 else None), index),
                                    **usage_now, **(on_last if last else {}),
                                    **(prompt_fields if i == 0 else {})})
                else:  # the prompt's parts (echo, prompt logprobs) come with the choice's first chunk
                    text, logprobs, vllm_prompt_logprobs = parts.completion(prompt_no, index, [chunk])
                    await send({**choices.indexed(oa.completion_body(rid, model.name, created, text,
                                                                     chunk.finish_reason, logprobs, None, chunk=True,
                                                                     vllm_prompt_logprobs=vllm_prompt_logprobs),
                                                  index), **usage_now, **on_last})
        if parsed.include_usage:
            usage = oa.usage_dict(TokenChunk(request_id=gen.request_id, seq=0, usage=choices.total_usage(finals)))
            await send({**oa.usage_chunk(rid, model.name, created, parsed.chat, usage), **extension})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.metrics.e2e.labels(model.name).observe(time.time() - arrival)
        return response


def parse_json(raw: bytes):
    try:
        body = json.loads(raw.decode())  # UTF-8 only (json.loads of bytes would accept UTF-16 and a BOM)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise oa.bad("the request body is not valid JSON") from None
    if not _encodable(body):  # "\ud800" is valid JSON but no UTF-8 text: the tokenizer and msgpack refuse it
        raise oa.bad("the request body contains a lone surrogate (\\ud800-\\udfff): not valid Unicode text")
    return body


def _encodable(value) -> bool:
    """Whether every string in a parsed JSON value (keys too) is encodable as UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode()
                except UnicodeEncodeError:
                    return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True
