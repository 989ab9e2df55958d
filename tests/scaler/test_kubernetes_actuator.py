"""The Kubernetes actuator against a fake API server (no cluster runs here): it reads and patches
the Deployment's scale subresource the way the real API expects, and the scaler drives it from
live signals on the bus."""

import asyncio
import time
import uuid

import pytest
from aiohttp import web

from services.control.spec import validate
from services.control.store import DeploymentStore
from services.scaler.actuators import KubernetesActuator
from services.scaler.service import ScalerConfig, ScalerService
from shared import protocol
from shared.bus import Bus
from shared.protocol import SchedulerStats
from shared.store import connect_redis

TOKEN = "test-service-account-token"


class FakeKubernetesApiServer:
    """Serves apps/v1 Deployment scale subresources for a fixed set of Deployments, checks the
    bearer token and the merge-patch content type, and records every call. A fake: it stands in
    for a cluster's API server, which cannot run on this machine."""

    def __init__(self, namespace: str, deployments: dict[str, int]):
        self.namespace = namespace
        self.replicas = dict(deployments)
        self.calls: list[tuple[str, str, dict | None]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _scale(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        ns, name = request.match_info["ns"], request.match_info["name"]
        if ns != self.namespace or name not in self.replicas:
            return web.json_response({"kind": "Status", "code": 404,
                                      "message": f'deployments.apps "{name}" not found'}, status=404)
        body = None
        if request.method == "PATCH":
            if request.content_type != "application/merge-patch+json":
                return web.json_response({"kind": "Status", "code": 415, "message": "bad patch type"}, status=415)
            body = await request.json()
            self.replicas[name] = int(body["spec"]["replicas"])
        self.calls.append((request.method, name, body))
        return web.json_response({"kind": "Scale", "apiVersion": "autoscaling/v1",
                                  "metadata": {"name": name, "namespace": ns},
                                  "spec": {"replicas": self.replicas[name]},
                                  "status": {"replicas": self.replicas[name], "selector": f"app={name}"}})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_route("*", "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", self._scale)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self._runner.cleanup()


async def test_scale_reads_then_patches_only_on_change(tiny_model_dir):
    spec = validate({"name": "llm", "model": str(tiny_model_dir)})
    async with FakeKubernetesApiServer("strata", {"strata-engine-llm": 1}) as api:
        actuator = KubernetesActuator(api.url, "strata", token=TOKEN)
        try:
            await actuator.scale("llm", 1, spec, 3, {})
            assert api.replicas["strata-engine-llm"] == 3
            assert [(m, b) for m, _, b in api.calls] == [("GET", None), ("PATCH", {"spec": {"replicas": 3}})]
            assert actuator.starting("llm", 1, ready=1) == 2
            api.calls.clear()
            await actuator.scale("llm", 1, spec, 3, {})  # already there: read only
            assert [m for m, _, _ in api.calls] == ["GET"]
            # Revisions add up on the one Deployment (the cluster rolls its pods itself).
            await actuator.scale("llm", 2, spec, 1, {})
            assert api.replicas["strata-engine-llm"] == 4
            await actuator.scale("llm", 1, spec, 0, {})
            assert api.replicas["strata-engine-llm"] == 1 and actuator.revisions("llm") == {2}
            with pytest.raises(RuntimeError, match="404.*not found"):
                await actuator.scale("missing", 1, spec, 1, {})
        finally:
            await actuator.close()


async def test_scaler_scales_a_deployment_from_zero_through_the_api(infra, tiny_model_dir):
    name = f"k8s-{uuid.uuid4().hex[:6]}"
    redis = connect_redis(infra.redis_url)
    bus = await Bus.connect(infra.nats_url, "test-k8s")
    async with FakeKubernetesApiServer("strata", {f"strata-engine-{name}": 0}) as api:
        scaler = ScalerService(ScalerConfig(infra.nats_url, infra.redis_url, "k8s-test", interval=0.2),
                               KubernetesActuator(api.url, "strata", token=TOKEN))
        await scaler.start()
        try:
            await DeploymentStore(redis).apply(validate({
                "name": name, "model": str(tiny_model_dir), "replicas": {"min": 0, "max": 3}}))
            await bus.publish(protocol.CONTROL_DEPLOYMENTS, protocol.DeploymentChanged(name=name, action="apply",
                                                                                     generation=1, stable=1))
            await asyncio.sleep(1.0)
            assert api.replicas[f"strata-engine-{name}"] == 0  # min 0, no demand: nothing to run
            deadline = time.monotonic() + 15
            while api.replicas[f"strata-engine-{name}"] == 0 and time.monotonic() < deadline:
                # A request waits in a scheduler's queue: the scaler's signal to start a replica.
                await bus.publish(protocol.scheduler_stats("sched-x"), SchedulerStats(
                    scheduler_id="sched-x", queue_depth={name: 3}, oldest_wait_s={name: 0.5},
                    timestamp=time.time()))
                await asyncio.sleep(0.2)
            assert 1 <= api.replicas[f"strata-engine-{name}"] <= 3
            assert any(m == "PATCH" for m, _, _ in api.calls)
        finally:
            await scaler.stop()
            await DeploymentStore(redis).delete(name)  # the session's Valkey is shared with other stacks
            await bus.close()
            await redis.aclose()
