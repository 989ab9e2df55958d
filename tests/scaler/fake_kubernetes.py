"""A fake Kubernetes API server for the scaler's tests (no cluster runs on this machine): a real
HTTP server on loopback serving apps/v1 Deployments and their scale subresource the way the
real API does (bearer token, merge-patch content type, Status objects on errors).

It models what matters to capacity: `gpus` is how many pods the cluster can run (pods beyond
stay Pending, so `readyReplicas` stays below `spec.replicas`), and `refuse_scale_up` makes it
answer a scale-up with 403 Forbidden (an admission policy or a quota saying no). Every call is
recorded with its time and status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

TOKEN = "test-service-account-token"


@dataclass
class Call:
    at: float  # time.monotonic()
    method: str
    name: str
    body: dict | None
    status: int


class FakeKubernetesApiServer:
    def __init__(self, namespace: str, deployments: dict[str, int], gpus: int | None = None, token: str = TOKEN):
        self.namespace = namespace
        self.replicas = dict(deployments)  # Deployment name -> spec.replicas
        self.gpus = gpus  # pods the cluster can run (None: as many as asked)
        self.refuse_scale_up: str | None = None  # a message: scale-ups get 403 Forbidden with it
        self.token = token
        self.calls: list[Call] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    def ready(self, name: str) -> int:
        """Pods running: the cluster's GPUs go to Deployments in name order (the rest Pending)."""
        free = self.gpus
        for other in sorted(self.replicas):
            n = self.replicas[other] if free is None else min(self.replicas[other], max(free, 0))
            if other == name:
                return n
            free = None if free is None else free - n
        return 0

    def patches(self, name: str, accepted: bool = True) -> list[Call]:
        return [c for c in self.calls if c.method == "PATCH" and c.name == name and (c.status < 400) == accepted]

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                  "reason": reason, "message": message}, status=code)

    async def _handle(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        body = None
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            response = self._status(401, "Unauthorized", "Unauthorized")
        elif ns != self.namespace or name not in self.replicas:
            response = self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        elif request.method == "PATCH" and request.content_type != "application/merge-patch+json":
            response = self._status(415, "UnsupportedMediaType", "bad patch type")
        elif request.method == "PATCH":
            body = await request.json()
            wanted = int(body["spec"]["replicas"])
            if self.refuse_scale_up and wanted > self.replicas[name]:
                response = self._status(403, "Forbidden", self.refuse_scale_up)
            else:
                self.replicas[name] = wanted
                response = self._object(request, ns, name)
        else:
            response = self._object(request, ns, name)
        self.calls.append(Call(time.monotonic(), request.method, name, body, response.status))
        return response

    def _object(self, request: web.Request, ns: str, name: str) -> web.Response:
        replicas, ready = self.replicas[name], self.ready(name)
        if request.path.endswith("/scale"):
            return web.json_response({"kind": "Scale", "apiVersion": "autoscaling/v1",
                                      "metadata": {"name": name, "namespace": ns}, "spec": {"replicas": replicas},
                                      "status": {"replicas": replicas, "selector": f"app={name}"}})
        status = {"replicas": replicas, "updatedReplicas": replicas}
        if ready:  # the real API leaves out counts that are zero
            status.update(readyReplicas=ready, availableReplicas=ready)
        if replicas - ready:
            status["unavailableReplicas"] = replicas - ready
        return web.json_response({"kind": "Deployment", "apiVersion": "apps/v1",
                                  "metadata": {"name": name, "namespace": ns}, "spec": {"replicas": replicas},
                                  "status": status})

    async def __aenter__(self):
        app = web.Application()
        base = "/apis/apps/v1/namespaces/{ns}/deployments/{name}"
        app.router.add_route("*", base, self._handle)
        app.router.add_route("*", base + "/scale", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self._runner.cleanup()
