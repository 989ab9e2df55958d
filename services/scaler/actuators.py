"""Actuators: how the scaler's replica counts become engines. One interface, two backends.

- LocalProcessActuator starts and stops engine workers on this machine (the default under
  `strata up`). Scale-down sends SIGTERM to the least-loaded replica: the engine stops taking
  work, finishes its streams and exits (drain), so no stream is cut.
- KubernetesActuator sets the scale of a Deployment through the Kubernetes API; the kubelet
  sends SIGTERM to the pod it removes, and the engine drains the same way.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from services.engine.__main__ import engine_flags
from shared.deployments import DeploymentSpec
from shared.logging import get_logger

log = get_logger()


class Actuator(Protocol):
    async def scale(self, deployment: str, revision: int, spec: DeploymentSpec, replicas: int,
                    loads: dict[str, int]) -> None:
        """Make `replicas` engines serve this revision; `loads` (replica id -> requests on it)
        says which to drain first when scaling down."""

    def starting(self, deployment: str, revision: int, ready: int) -> int:
        """Replicas asked for and not ready yet (capacity on its way); `ready` is how many the
        heartbeats show ready."""

    def note_ready(self, replica_id: str) -> float | None:
        """A replica reported ready; returns its cold-start time in seconds when known."""

    def revisions(self, deployment: str) -> set[int]:
        """Revisions that have replicas (so revisions no longer served get scaled to zero)."""

    async def close(self) -> None: ...


@dataclass
class LocalReplica:
    replica_id: str
    proc: subprocess.Popen
    started_at: float
    ready: bool = False
    draining: bool = False


@dataclass
class LocalProcessActuator:
    nats_url: str
    redis_url: str
    log_dir: Path
    extra_args: list[str] = field(default_factory=list)  # given to every engine (e.g. --threads 1)
    engine_env: dict[str, str] = field(default_factory=dict)  # e.g. the engine role's NATS credentials
    stop_timeout: float = 60.0  # drain time allowed at close()
    groups: dict[tuple[str, int], dict[str, LocalReplica]] = field(default_factory=dict)

    def _reap(self, key: tuple[str, int]) -> dict[str, LocalReplica]:
        group = self.groups.setdefault(key, {})
        for rid, replica in list(group.items()):
            code = replica.proc.poll()
            if code is not None:
                if not replica.draining:
                    log.warning("engine exited unexpectedly", replica_id=rid, exit_code=code)
                del group[rid]
        return group

    async def scale(self, deployment: str, revision: int, spec: DeploymentSpec, replicas: int,
                    loads: dict[str, int]) -> None:
        group = self._reap((deployment, revision))
        active = [r for r in group.values() if not r.draining]
        for _ in range(replicas - len(active)):
            self._start(deployment, revision, spec, group)
        if len(active) > replicas:
            # Not-ready ones first (nothing to drain), then the least loaded.
            victims = sorted(active, key=lambda r: (r.ready, loads.get(r.replica_id, 0)))[:len(active) - replicas]
            for replica in victims:
                replica.draining = True
                replica.proc.send_signal(signal.SIGTERM)
                log.info("engine draining", replica_id=replica.replica_id, deployment=deployment, revision=revision,
                         load=loads.get(replica.replica_id, 0))

    def _start(self, deployment: str, revision: int, spec: DeploymentSpec, group: dict[str, LocalReplica]) -> None:
        replica_id = f"{deployment}-r{revision}-{uuid.uuid4().hex[:6]}"
        args = [sys.executable, "-m", "services.engine", "--model", spec.model, "--replica-id", replica_id,
                "--deployment", deployment, "--revision", str(revision), "--nats-url", self.nats_url,
                "--redis-url", self.redis_url, "--log-format", "json", *engine_flags(spec.engine), *self.extra_args]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{replica_id}.log", "ab") as log_file:
            proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                    env={**os.environ, **self.engine_env})
        group[replica_id] = LocalReplica(replica_id, proc, time.monotonic())
        log.info("engine started", replica_id=replica_id, deployment=deployment, revision=revision, pid=proc.pid)

    def starting(self, deployment: str, revision: int, ready: int) -> int:
        group = self._reap((deployment, revision))
        return sum(not r.ready and not r.draining for r in group.values())

    def note_ready(self, replica_id: str) -> float | None:
        for group in self.groups.values():
            replica = group.get(replica_id)
            if replica is not None and not replica.ready:
                replica.ready = True
                return time.monotonic() - replica.started_at
        return None

    def revisions(self, deployment: str) -> set[int]:
        return {rev for (dep, rev), group in self.groups.items() if dep == deployment and group}

    def replicas(self, deployment: str, revision: int) -> list[LocalReplica]:
        return list(self._reap((deployment, revision)).values())

    async def close(self) -> None:
        """Drain every engine this actuator started, then make sure they are gone."""
        procs = [r.proc for g in self.groups.values() for r in g.values() if r.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        self.groups.clear()


class KubernetesActuator:
    """Scales the Deployment `<prefix><deployment>` through the Kubernetes API (apps/v1 scale
    subresource). In a cluster it finds the API server and its token in the pod's service
    account; outside, api_url and token are given. Revisions are the Deployment's own rollout
    there: the scaler sets one count per deployment (the sum over revisions)."""

    SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

    def __init__(self, api_url: str = "", namespace: str = "", prefix: str = "strata-engine-", token: str = "",
                 timeout: float = 5.0):
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.api_url = api_url or (f"https://{host}:{port}" if host else "")
        if not self.api_url:
            raise ValueError("no Kubernetes API: give --k8s-api-url, or run in a pod")
        self.namespace = namespace or self._read_sa("namespace") or "default"
        self.token = token or self._read_sa("token")
        self.prefix = prefix
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        ca = self.SA_DIR / "ca.crt"
        self.ssl = ssl.create_default_context(cafile=str(ca)) if ca.exists() else None
        self._session: aiohttp.ClientSession | None = None
        self._wanted: dict[str, dict[int, int]] = {}  # deployment -> revision -> replicas

    def _read_sa(self, name: str) -> str:
        path = self.SA_DIR / name
        return path.read_text().strip() if path.exists() else ""

    def _url(self, deployment: str) -> str:
        return f"{self.api_url}/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.prefix}{deployment}/scale"

    async def _request(self, method: str, url: str, json_body: dict | None = None) -> dict:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=self.timeout)
        content_type = {"Content-Type": "application/merge-patch+json"} if json_body is not None else {}
        async with self._session.request(method, url, json=json_body, headers=content_type, ssl=self.ssl) as resp:
            body = await resp.json(content_type=None)
            if resp.status >= 400:
                raise RuntimeError(f"Kubernetes API {method} {url}: {resp.status} {body.get('message', body)}")
            return body

    async def scale(self, deployment: str, revision: int, spec: DeploymentSpec, replicas: int,
                    loads: dict[str, int]) -> None:
        wanted = self._wanted.setdefault(deployment, {})
        wanted[revision] = replicas
        if replicas == 0:
            wanted.pop(revision)
        total = sum(wanted.values())
        scale = await self._request("GET", self._url(deployment))
        current = int(scale.get("spec", {}).get("replicas", 0))
        if current != total:
            await self._request("PATCH", self._url(deployment), {"spec": {"replicas": total}})
            log.info("kubernetes deployment scaled", deployment=f"{self.prefix}{deployment}", replicas=total,
                     was=current)

    def starting(self, deployment: str, revision: int, ready: int) -> int:
        return max(self._wanted.get(deployment, {}).get(revision, 0) - ready, 0)

    def note_ready(self, replica_id: str) -> float | None:
        return None  # pods start without us: no start time to measure from

    def revisions(self, deployment: str) -> set[int]:
        return set(self._wanted.get(deployment, {}))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
