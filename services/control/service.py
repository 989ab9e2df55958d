"""Control: the deployment API (REST, admin key), the live fleet view, and the dashboard.

Every change is stored in Redis as a revision or a state change (services.control.store) and
announced on CONTROL_DEPLOYMENTS; the gateway, schedulers and scaler pick it up without a
restart. The fleet view (heartbeats, scheduler stats, scaler decisions) feeds `strata status`
and the dashboard.

Control holds a copy of every deployment (shared.deployments.DeploymentWatcher). When the store
loses them (Valkey restarted empty, a failover to a replica without the data), it writes its copy
back and announces each again: the desired state stands until someone changes it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from services.control import spec as specs
from services.control.canary_driver import CanaryDriver, read_run
from services.control.fleet import FleetView
from services.control.pools_api import PoolsApi, unknown_pools
from services.control.store import DeploymentError, DeploymentStore
from services.gateway.auth import ApiKey, KeyNotFound, KeyStore, create_key, hash_key, key_id, list_keys, revoke_key
from services.gateway.openai_api import ApiError, error_response
from shared import adapters, deployments, http, protocol, registry
from shared.bus import Bus, NatsAuth
from shared.logging import get_logger
from shared.pools import PoolSpecError
from shared.protocol import (DeploymentChanged, GatewayStats, Heartbeat, KeyRevoked, PoolStatus, ScalerDecision,
                             SchedulerStats)
from shared.store import StoreEpoch, connect_redis

log = get_logger()
STATIC = Path(__file__).parent / "static"


@dataclass
class ControlConfig:
    nats_url: str
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 8081
    control_id: str = "control"
    sample_interval: float = 2.0
    nats_auth: NatsAuth = field(default_factory=NatsAuth)


class ControlService:
    def __init__(self, cfg: ControlConfig):
        self.cfg = cfg
        self.fleet = FleetView()
        self.bus: Bus | None = None
        self.redis = None
        self.store: DeploymentStore | None = None
        self.keys: KeyStore | None = None
        self.registry = CollectorRegistry()
        self.changes = Counter("strata:control_deployment_changes", "Deployment changes by action.", ["action"],
                               registry=self.registry)
        self.restores = Counter("strata:control_deployments_restored",
                                "Deployments written back after the store lost them.", registry=self.registry)
        self.deployments: deployments.DeploymentWatcher | None = None
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task | None = None
        self.pools = PoolsApi(lambda: self.redis, self.fleet, lambda: self.bus, self._admin)
        self.analysis: CanaryDriver | None = None
        self.url = ""

    async def start(self) -> None:
        structlog.contextvars.bind_contextvars(control_id=self.cfg.control_id)
        self.bus = await Bus.connect(self.cfg.nats_url, f"control-{self.cfg.control_id}", auth=self.cfg.nats_auth)
        self.redis = connect_redis(self.cfg.redis_url, f"control-{self.cfg.control_id}")
        self.store = DeploymentStore(self.redis)
        self.keys = KeyStore(self.redis, cache_ttl=2.0)
        self.deployments = deployments.DeploymentWatcher(self.redis)
        await self.deployments.start(self.bus)
        self.analysis = CanaryDriver(self.redis, self.store, self._announce, self.registry)
        await self.bus.subscribe(protocol.HEARTBEAT_ALL, Heartbeat, self._on_heartbeat)
        await self.bus.subscribe(protocol.SCHEDULER_STATS_ALL, SchedulerStats, self._on_scheduler_stats)
        await self.bus.subscribe(protocol.SCALER_STATUS, ScalerDecision, self._on_scaler_decision)
        await self.bus.subscribe(protocol.GATEWAY_STATS_ALL, GatewayStats, self._on_gateway_stats)
        await self.bus.subscribe(protocol.SCALER_POOLS, PoolStatus, self._on_pool_status)
        await self.bus.subscribe(protocol.CONTROL_KEYS, KeyRevoked, self._on_key_revoked)  # other controls' revocations
        self._sampler = asyncio.create_task(self._sample_loop())
        self.analysis.start()
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.url = http.advertised_url(self.cfg.host, site._server.sockets[0].getsockname()[1])
        self._announcer = asyncio.create_task(registry.keep_announced(self.redis, "control", self.cfg.control_id,
                                                                      {"http_url": self.url}))
        self._guards = [asyncio.create_task(self.keys.watch()), asyncio.create_task(self._restore_loop())]
        log.info("control ready", url=self.url)

    async def stop(self) -> None:
        self._sampler.cancel()
        self._announcer.cancel()
        for task in self._guards:
            task.cancel()
        self.deployments.stop()
        await self.analysis.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.bus.close()
        await self.redis.aclose()

    async def _on_heartbeat(self, hb: Heartbeat, _raw) -> None:
        self.fleet.on_heartbeat(hb)

    async def _on_scheduler_stats(self, stats: SchedulerStats, _raw) -> None:
        self.fleet.on_scheduler_stats(stats)

    async def _on_scaler_decision(self, decision: ScalerDecision, _raw) -> None:
        self.fleet.on_scaler_decision(decision)

    async def _on_key_revoked(self, msg: KeyRevoked, _raw) -> None:
        self.keys.forget(msg.key_hash)

    async def _on_gateway_stats(self, stats: GatewayStats, _raw) -> None:
        self.fleet.on_gateway_stats(stats)
        self.analysis.on_gateway_stats(stats)

    async def _on_pool_status(self, status: PoolStatus, _raw) -> None:
        self.fleet.on_pool_status(status)
    async def _restore_loop(self, interval: float = 1.0) -> None:
        """Write back (and announce) the deployments the store lost, as soon as it is seen."""
        epoch = StoreEpoch(self.redis)
        while True:
            try:
                lost = await epoch.lost()
                missing = set(self.deployments.deployments) if lost else set(self.deployments.lost)
                if lost:
                    log.error("the store lost its data: restoring the deployments control holds",
                              deployments=sorted(missing))
                await self.restore(missing)
            except Exception as exc:  # Redis away: the next round tells
                log.debug("store check failed", error=str(exc))
            await asyncio.sleep(interval)

    async def restore(self, names) -> None:
        for name in sorted(names):
            deployment = self.deployments.deployments.get(name)
            if deployment is not None and await self.store.restore(deployment, actor=self.cfg.control_id):
                self.restores.inc()
                log.warning("deployment restored", deployment=name, generation=deployment.state.generation)
                await self._announce(name, "restore", deployment.state)

    async def _sample_loop(self) -> None:
        while True:
            self.fleet.sample()
            try:  # deleted deployments (whose replicas may still drain) leave the fleet view
                kept = set(await deployments.list_names(self.redis)) | self.fleet.deployments(unmanaged_only=True)
                for name in set(self.fleet.history) - kept:
                    self.fleet.forget(name)
            except Exception as exc:  # Redis away: keep the history until it answers
                log.warning("deployment list failed", error=str(exc))
            await asyncio.sleep(self.cfg.sample_interval)

    # ---- http plumbing ----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/", lambda _r: web.HTTPFound("/dashboard"))
        app.router.add_get("/dashboard", self.dashboard)
        app.router.add_get("/api/v1/deployments", self.list_deployments)
        app.router.add_post("/api/v1/deployments", self.apply)
        app.router.add_get("/api/v1/deployments/{name}", self.get_deployment)
        app.router.add_delete("/api/v1/deployments/{name}", self.delete)
        app.router.add_post("/api/v1/deployments/{name}/canary", self.canary)
        app.router.add_post("/api/v1/deployments/{name}/promote", self.promote)
        app.router.add_post("/api/v1/deployments/{name}/rollback", self.rollback)
        app.router.add_get("/api/v1/deployments/{name}/history", self.history)
        app.router.add_get("/api/v1/deployments/{name}/canary", self.canary_status)
        app.router.add_post("/api/v1/keys", self.create_key)
        app.router.add_get("/api/v1/keys", self.get_keys)
        app.router.add_delete("/api/v1/keys/{id}", self.delete_key)
        app.router.add_get("/prometheus/targets", self.prometheus_targets)
        app.router.add_get("/api/v1/overview", self.overview)
        self.pools.add_routes(app.router)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except (specs.SpecError, PoolSpecError) as exc:
            what = "pool" if isinstance(exc, PoolSpecError) else "deployment"
            response = error_response(ApiError(400, f"invalid {what} spec: {exc}", "invalid_request_error",
                                               exc.errors[0][0], "invalid_spec"))
            body = json.loads(response.body)
            body["error"]["errors"] = [{"field": f, "reason": r} for f, r in exc.errors]
            return web.json_response(body, status=400)
        except DeploymentError as exc:
            return error_response(ApiError(exc.status, str(exc), "invalid_request_error", None, exc.code))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(ApiError(exc.status, exc.reason or "error"))
        except Exception:
            log.exception("unhandled error", path=request.path)
            return error_response(ApiError(500, "internal error", "server_error"))

    async def _admin(self, request: web.Request) -> ApiKey:
        key = await self.keys.authenticate(request.headers.get("Authorization", ""))
        if not key.admin:
            raise ApiError(403, "this API needs an admin key", "permission_error", None, "forbidden")
        structlog.contextvars.bind_contextvars(actor=key.tenant)
        return key

    @staticmethod
    async def _json(request: web.Request) -> dict:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def _announce(self, name: str, action: str, state) -> None:
        self.changes.labels(action).inc()
        msg = DeploymentChanged(name=name, action=action, generation=state.generation if state else 0,
                                stable=state.stable if state else 0, canary=state.canary if state else 0,
                                canary_weight=state.canary_weight if state else 0)
        await self.bus.publish(protocol.CONTROL_DEPLOYMENTS, msg)
        log.info("deployment changed", deployment=name, action=action,
                 stable=msg.stable, canary=msg.canary, canary_weight=msg.canary_weight)

    async def _state(self, name: str) -> deployments.DeploymentState:
        state = await deployments.read_state(self.redis, name)
        if state is None:
            raise ApiError(404, f"deployment {name} does not exist", "invalid_request_error", "name", "not_found")
        return state

    # ---- routes -----------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        connected = self.bus is not None and self.bus.nc.is_connected
        return web.json_response({"status": "ok" if connected else "degraded"}, status=200 if connected else 503)

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def dashboard(self, _request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "dashboard.html")

    async def apply(self, request: web.Request) -> web.Response:
        key = await self._admin(request)
        text = await request.text()
        data = specs.parse_spec(text)
        loop = asyncio.get_running_loop()  # reads the model's config.json: off the loop
        spec = await loop.run_in_executor(None, specs.validate, data)
        if spec.placement.pools or spec.placement.shares:  # pools are live: they must exist when named
            errors = unknown_pools(spec.placement, set(await self.pools.store.list()))
            if errors:
                raise specs.SpecError(errors)
        live = await self.store.adapters_only(spec)  # adapters alone: applied live, no new revision
        state = await (self.store.record_adapters(spec.name, actor=key.tenant) if live
                       else self.store.apply(spec, actor=key.tenant))
        changed, removed = await adapters.replace_declared(self.redis, spec.name, spec.adapters)
        if changed or removed:
            await adapters.announce(self.bus, spec.name, "spec")
            log.info("lora adapters applied", deployment=spec.name, loaded=changed, unloaded=removed)
        await self._announce(spec.name, "adapters" if live else "apply", state)
        if not live:
            await self.analysis.refresh(spec.name)  # a canary with an analysis: it starts now
        return web.json_response({"deployment": asdict(state), "revision": state.latest, "serving": state.serving(),
                                  "analysis": spec.canary.get("analysis") if state.canary == state.latest else None,
                                  "live": live, "adapters": {"loaded": changed, "unloaded": removed}},
                                 status=200 if live else 201)

    async def list_deployments(self, request: web.Request) -> web.Response:
        await self._admin(request)
        out = []
        for name in await deployments.list_names(self.redis):
            state = await deployments.read_state(self.redis, name)
            if state is not None:
                out.append({**asdict(state), "serving": state.serving(),
                            "replicas_ready": sum(r["state"] == "ready" for r in self.fleet.status(name)["replicas"])})
        return web.json_response({"deployments": out})

    async def get_deployment(self, request: web.Request) -> web.Response:
        await self._admin(request)
        return web.json_response(await self._describe(request.match_info["name"]))

    async def _describe(self, name: str) -> dict:
        state = await self._state(name)
        serving = state.serving()
        revs = {}
        for rev in sorted(set(serving) | {state.latest}):
            spec = await deployments.read_spec(self.redis, name, rev)
            if spec is not None:
                revs[rev] = {"model": spec.model, "replicas": asdict(spec.replicas), "slo": asdict(spec.slo),
                             "traffic_percent": serving.get(rev, 0)}
        fleet = self.fleet.status(name)
        live, _ = await registry.sweep(self.redis, name)  # the replicas' advertised /metrics
        for replica in fleet["replicas"]:
            url = live.get(replica["replica_id"], {}).get("http_url")
            replica["metrics_url"] = f"{url}/metrics" if url else None
        run = await read_run(self.redis, name)
        return {"deployment": asdict(state), "serving": serving, "revisions": revs, **fleet,
                "analysis": run.to_dict() if run else None}

    async def delete(self, request: web.Request) -> web.Response:
        await self._admin(request)
        name = request.match_info["name"]
        await self.store.delete(name)
        self.fleet.forget(name)
        await self._announce(name, "delete", None)
        return web.json_response({"deleted": name})

    async def canary(self, request: web.Request) -> web.Response:
        key = await self._admin(request)
        name, body = request.match_info["name"], await self._json(request)
        weight, revision = body.get("weight"), body.get("revision")
        if not isinstance(weight, int) or isinstance(weight, bool):
            raise ApiError(400, "weight must be an integer percentage", "invalid_request_error", "weight")
        if revision is not None and (not isinstance(revision, int) or isinstance(revision, bool)):
            raise ApiError(400, "revision must be an integer", "invalid_request_error", "revision")
        state = await self.store.set_canary(name, weight, revision, actor=key.tenant)
        await self._announce(name, "canary", state)
        return web.json_response({"deployment": asdict(state), "serving": state.serving()})

    async def promote(self, request: web.Request) -> web.Response:
        key = await self._admin(request)
        name = request.match_info["name"]
        state = await self.store.promote(name, actor=key.tenant)
        await self._announce(name, "promote", state)
        return web.json_response({"deployment": asdict(state), "serving": state.serving()})

    async def rollback(self, request: web.Request) -> web.Response:
        key = await self._admin(request)
        name, body = request.match_info["name"], await self._json(request)
        to = body.get("to")
        if to is not None and (not isinstance(to, int) or isinstance(to, bool)):
            raise ApiError(400, "to must be a revision number", "invalid_request_error", "to")
        state = await self.store.rollback(name, to, actor=key.tenant)
        await self._announce(name, "rollback", state)
        return web.json_response({"deployment": asdict(state), "serving": state.serving()})

    async def history(self, request: web.Request) -> web.Response:
        await self._admin(request)
        name = request.match_info["name"]
        state = await self._state(name)
        revs = await deployments.revisions(self.redis, name, state.latest)
        return web.json_response({"deployment": asdict(state),
                                  "revisions": {rev: spec.to_dict() for rev, spec in revs.items()},
                                  "events": await deployments.history(self.redis, name)})

    async def create_key(self, request: web.Request) -> web.Response:
        await self._admin(request)
        body = await self._json(request)
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "name (the tenant) is required", "invalid_request_error", "name")
        rpm, tpm = body.get("rpm", 0), body.get("tpm", 0)
        priority, admin = body.get("priority", "standard"), body.get("admin", False)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (rpm, tpm)):
            raise ApiError(400, "rpm and tpm must be non-negative integers", "invalid_request_error", "rpm")
        if priority not in protocol.PRIORITIES or not isinstance(admin, bool):
            raise ApiError(400, "priority must be critical, standard or sheddable; admin true or false",
                           "invalid_request_error", "priority")
        api_key = await create_key(self.redis, name, rpm=rpm, tpm=tpm, priority=priority, admin=admin)
        return web.json_response({"api_key": api_key, "name": name, "id": key_id(hash_key(api_key))}, status=201)

    async def get_keys(self, request: web.Request) -> web.Response:
        await self._admin(request)
        return web.json_response({"keys": await list_keys(self.redis)})

    async def delete_key(self, request: web.Request) -> web.Response:
        """Delete a key and tell every gateway at once (each drops its cached lookup); a gateway
        that misses the message forgets it when its cache entry expires."""
        await self._admin(request)
        try:
            key_hash = await revoke_key(self.redis, request.match_info["id"])
        except KeyNotFound as exc:
            raise ApiError(404, str(exc), "invalid_request_error", "id", "not_found") from None
        self.keys.forget(key_hash)
        await self.bus.publish(protocol.CONTROL_KEYS, KeyRevoked(key_hash=key_hash))
        log.info("api key revoked", key_id=key_id(key_hash))
        return web.json_response({"revoked": key_id(key_hash)})

    async def canary_status(self, request: web.Request) -> web.Response:
        await self._admin(request)
        name = request.match_info["name"]
        state = await self._state(name)
        run = await read_run(self.redis, name)
        if run is None:
            raise ApiError(404, f"deployment {name} has no canary analysis (give its canary an analysis: "
                                f"canary: {{analysis: {{steps: [5, 25, 50, 100]}}}})", "invalid_request_error", "name",
                           "not_found")
        return web.json_response({"deployment": asdict(state), "serving": state.serving(), "analysis": run.to_dict()})

    async def prometheus_targets(self, request: web.Request) -> web.Response:
        """Prometheus HTTP service discovery (http_sd_configs): every registered engine (and with
        ?kind=all, gateway, scheduler, scaler and control), labelled with its deployment and
        revision. Addresses only, like /metrics: no key needed."""
        kind = request.query.get("kind", "engine")
        if kind not in ("engine", "all"):
            raise ApiError(400, "kind must be engine or all", "invalid_request_error", "kind")
        groups = []
        for model in await registry.models(self.redis):
            live, _ = await registry.sweep(self.redis, model)
            for replica, fields in sorted(live.items()):
                if fields.get("http_url"):
                    groups.append({"targets": [fields["http_url"].split("://", 1)[1]],
                                   "labels": {"kind": "engine", "deployment": fields.get("deployment", model),
                                              "revision": fields.get("revision", "0"), "replica_id": replica}})
        if kind == "all":
            for service in ("gateway", "scheduler", "scaler", "control"):
                for instance, fields in (await registry.services(self.redis, service)).items():
                    if fields.get("http_url"):
                        groups.append({"targets": [fields["http_url"].split("://", 1)[1]],
                                       "labels": {"kind": service, "instance_id": instance}})
        return web.json_response(groups)

    async def overview(self, request: web.Request) -> web.Response:
        """Everything the dashboard draws, in one call."""
        await self._admin(request)
        # Stored deployments, and models that live replicas serve outside control (revision 0): a
        # deleted deployment's draining replicas do not keep it on the dashboard.
        names = set(await deployments.list_names(self.redis)) | self.fleet.deployments(unmanaged_only=True)
        out = []
        for name in sorted(names):
            state = await deployments.read_state(self.redis, name)
            run = await read_run(self.redis, name) if state else None
            out.append({"name": name, "deployment": asdict(state) if state else None,
                        "serving": state.serving() if state else {}, **self.fleet.status(name),
                        "series": self.fleet.series(name), "layers": self.fleet.layers(name),
                        "analysis": run.to_dict() if run else None})
        return web.json_response({"at": time.time(), "deployments": out, "pools": await self.pools.overview()})
