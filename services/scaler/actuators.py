"""Actuators: how the scaler's replica counts become engines. One interface, two backends; each
capacity pool (shared.pools) has its own actuator.

- LocalProcessActuator starts and stops engine workers on this machine (the default under
  `strata up`). Scale-down sends SIGTERM to the least-loaded replica: the engine stops taking
  work, finishes its streams and exits (drain), so no stream is cut. With a capacity it is a
  pool that holds at most that many engines: asked for more, it starts what fits and refuses.
- KubernetesActuator sets the scale of a Deployment through one cluster's Kubernetes API; the
  kubelet sends SIGTERM to the pod it removes, and the engine drains the same way. The API
  refusing a scale-up, or pods it asked for still not ready after a timeout (the cluster has no
  room for them), is the pool refusing.
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

from services.engine.launch import CoreShares, engine_flags
from services.scaler.placement import Held
from shared.deployments import DeploymentSpec
from shared.logging import get_logger
from shared.pools import PoolSpec

log = get_logger()


class PoolRefused(RuntimeError):
    """A pool cannot place what it was asked for: quota exhausted, pods pending past a timeout,
    the local pool at its limit, the cluster's API refusing or unreachable. `held`: the
    replicas it holds (every deployment), which placement takes as its capacity for a while."""

    def __init__(self, reason: str, held: int):
        self.reason, self.held = reason, held
        super().__init__(reason)


class Actuator(Protocol):
    async def scale(self, deployment: str, revision: int, spec: DeploymentSpec, replicas: int,
                    loads: dict[str, int]) -> None:
        """Make `replicas` engines serve this revision; `loads` (replica id -> requests on it)
        says which to drain first when scaling down. Raises PoolRefused when it cannot."""

    async def observe(self, deployments: list[str]) -> None:
        """Read what the pool holds now (before placement, every tick)."""

    def held(self, deployment: str, revision: int) -> Held:
        """Ready, starting and draining replicas of this revision in the pool."""

    def alive(self) -> int:
        """Replicas the pool holds for every deployment (ready, starting and draining): what
        counts against its capacity."""

    def set_capacity(self, replicas: int) -> None:
        """The pool's capacity changed (the local pool enforces it; a cluster has its own quota)."""

    def starting(self, deployment: str, revision: int, ready: int) -> int:
        """Replicas asked for and not ready yet (capacity on its way); `ready` is how many the
        heartbeats show ready."""

    def note_ready(self, replica_id: str) -> float | None:
        """A replica reported ready; returns its cold-start time in seconds when known."""

    def take_cold_starts(self) -> list[float]:
        """Cold starts measured since the last call (seconds from asking for a replica to its
        being ready)."""

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
    capacity: int | None = None  # engines this pool may run, every deployment and draining ones too (None: no limit)
    pool: str = ""  # the pool's name and region, which its engines report in their heartbeats
    region: str = ""
    # The machine's cores, split between the engines that may run on it at once (every local
    # pool of one scaler shares one): this pool's capacity, else its deployments' replicas.max.
    cores: CoreShares = field(default_factory=CoreShares)
    groups: dict[tuple[str, int], dict[str, LocalReplica]] = field(default_factory=dict)
    _max_replicas: dict[str, int] = field(default_factory=dict)  # deployment -> its spec's replicas.max
    _cold_starts: list[float] = field(default_factory=list)

    def _reap(self, key: tuple[str, int]) -> dict[str, LocalReplica]:
        group = self.groups.setdefault(key, {})
        for rid, replica in list(group.items()):
            code = replica.proc.poll()
            if code is not None:
                if not replica.draining:
                    log.warning("engine exited unexpectedly", replica_id=rid, exit_code=code)
                del group[rid]
        return group

    async def observe(self, deployments: list[str]) -> None:
        for key in list(self.groups):
            self._reap(key)
        self._plan_cores()  # engines that have exited no longer hold the machine

    def __post_init__(self) -> None:
        self._plan_cores()  # a pool's capacity counts from the start, before it runs an engine

    def set_capacity(self, replicas: int) -> None:
        self.capacity = replicas
        self._plan_cores()

    @property
    def _cores_owner(self) -> str:
        return f"local-pool {self.pool} {id(self)}"

    def _plan_cores(self) -> None:
        most = sum(self._max_replicas.values()) if self.capacity is None else self.capacity
        self.cores.plan(self._cores_owner, max(most, self.alive()))

    def alive(self) -> int:
        return sum(r.proc.poll() is None for g in self.groups.values() for r in g.values())

    def held(self, deployment: str, revision: int) -> Held:
        group = self._reap((deployment, revision)).values()
        return Held(ready=sum(r.ready and not r.draining for r in group),
                    starting=sum(not r.ready and not r.draining for r in group),
                    draining=sum(r.draining for r in group))

    async def scale(self, deployment: str, revision: int, spec: DeploymentSpec, replicas: int,
                    loads: dict[str, int]) -> None:
        group = self._reap((deployment, revision))
        active = [r for r in group.values() if not r.draining]
        wanted = replicas - len(active)
        if spec is not None:
            self._max_replicas[deployment] = spec.replicas.max
        elif replicas == 0:  # a revision no longer served (its served one, if any, comes with its spec)
            self._max_replicas.pop(deployment, None)
            self._plan_cores()
        fits = wanted if self.capacity is None or wanted <= 0 else max(min(wanted, self.capacity - self.alive()), 0)
        for _ in range(max(fits, 0)):
            self._start(deployment, revision, spec, group)
        if len(active) > replicas:
            # Not-ready ones first (nothing to drain), then the least loaded.
            victims = sorted(active, key=lambda r: (r.ready, loads.get(r.replica_id, 0)))[:len(active) - replicas]
            for replica in victims:
                replica.draining = True
                replica.proc.send_signal(signal.SIGTERM)
                log.info("engine draining", replica_id=replica.replica_id, deployment=deployment, revision=revision,
                         load=loads.get(replica.replica_id, 0), pool=self.pool)
        if 0 <= fits < wanted:  # a scale-down (wanted < 0) is never refused
            raise PoolRefused(f"local pool at its limit of {self.capacity} engines", held=self.alive())

    def _start(self, deployment: str, revision: int, spec: DeploymentSpec, group: dict[str, LocalReplica]) -> None:
        replica_id = f"{deployment}-r{revision}-{uuid.uuid4().hex[:6]}"
        args = engine_flags(spec.model, replica_id, deployment, self.nats_url, self.redis_url, revision=revision,
                            pool=self.pool, region=self.region, engine=spec.engine, extra=self.extra_args)
        self._plan_cores()
        args, env = self.cores.launch(args, {**os.environ, **self.engine_env})
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{replica_id}.log", "ab") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "services.engine", *args], stdout=log_file,
                                    stderr=subprocess.STDOUT, env=env)
        group[replica_id] = LocalReplica(replica_id, proc, time.monotonic())
        log.info("engine started", replica_id=replica_id, deployment=deployment, revision=revision, pid=proc.pid,
                 pool=self.pool)

    def starting(self, deployment: str, revision: int, ready: int) -> int:
        return self.held(deployment, revision).starting

    def note_ready(self, replica_id: str) -> float | None:
        for group in self.groups.values():
            replica = group.get(replica_id)
            if replica is not None and not replica.ready:
                replica.ready = True
                cold = time.monotonic() - replica.started_at
                self._cold_starts.append(cold)
                return cold
        return None

    def take_cold_starts(self) -> list[float]:
        taken, self._cold_starts = self._cold_starts, []
        return taken

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
        self.cores.plan(self._cores_owner, 0)


class KubernetesApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


class KubernetesActuator:
    """Scales the Deployment `<prefix><deployment>` in one cluster through its Kubernetes API
    (apps/v1: the Deployment's status for what is ready, its scale subresource to set the
    count). In a cluster it finds the API server and its token in the pod's service account;
    outside, api_url and token are given. Revisions are the Deployment's own rollout there: the
    scaler sets one count per deployment (the sum over revisions).

    Pods asked for and still not ready after `pending_timeout_s` mean the cluster has no room
    for them (Pending: no GPU, quota): the pool refuses, and so it does when the API refuses a
    scale-up or cannot be reached. Each replica's time from being asked for to ready is its
    measured cold start."""

    SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

    def __init__(self, api_url: str = "", namespace: str = "", prefix: str = "strata-engine-", token: str = "",
                 timeout: float = 5.0, pending_timeout_s: float = 300.0, ca_file: str = "", token_file: str = ""):
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.api_url = (api_url or (f"https://{host}:{port}" if host else "")).rstrip("/")
        if not self.api_url:
            raise ValueError("no Kubernetes API: give --k8s-api-url, or run in a pod")
        self.namespace = namespace or self._read_sa("namespace") or "default"
        self.token = token or ("" if token_file else self._read_sa("token"))
        self.token_file = token_file  # read when the client connects, so a rotated token is picked up
        self.prefix = prefix
        self.pending_timeout_s = pending_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.ca_file = ca_file  # given: it must exist (read when the client connects); else the pod's, if any
        ca = self.SA_DIR / "ca.crt"
        self.ssl = ssl.create_default_context(cafile=str(ca)) if not ca_file and ca.exists() else None
        self._session: aiohttp.ClientSession | None = None
        self._wanted: dict[str, dict[int, int]] = {}  # deployment -> revision -> replicas
        self._status: dict[str, tuple[int, int]] = {}  # deployment -> (spec.replicas, status.readyReplicas)
        self._asked: dict[str, list[float]] = {}  # deployment -> when each replica of spec.replicas was asked for
        self._cold_starts: list[float] = []

    def _read_sa(self, name: str) -> str:
        path = self.SA_DIR / name
        return path.read_text().strip() if path.exists() else ""

    def _deployment_url(self, deployment: str) -> str:
        return f"{self.api_url}/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.prefix}{deployment}"

    def _url(self, deployment: str) -> str:
        return self._deployment_url(deployment) + "/scale"

    async def _request(self, method: str, url: str, json_body: dict | None = None) -> dict:
        if self._session is None:
            if self.ca_file:
                try:
                    self.ssl = ssl.create_default_context(cafile=self.ca_file)
                except OSError as exc:
                    raise KubernetesApiError(0, f"cannot read the CA file {self.ca_file}: {exc.strerror or exc}") from None
            token = self.token
            if self.token_file:
                try:
                    token = Path(self.token_file).read_text().strip()
                except OSError as exc:
                    raise KubernetesApiError(0, f"cannot read the token file {self.token_file}: {exc.strerror}") from None
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=self.timeout)
        content_type = {"Content-Type": "application/merge-patch+json"} if json_body is not None else {}
        try:
            async with self._session.request(method, url, json=json_body, headers=content_type, ssl=self.ssl) as resp:
                body = await resp.json(content_type=None)
                if resp.status >= 400:
                    message = body.get("message", body) if isinstance(body, dict) else body
                    raise KubernetesApiError(resp.status, f"Kubernetes API {method} {url}: {resp.status} {message}")
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise KubernetesApiError(0, f"Kubernetes API {method} {url}: {exc.__class__.__name__}: {exc}") from None

    def _note_status(self, deployment: str, replicas: int, ready: int) -> None:
        """A read of the Deployment: keep one ask time per replica in spec.replicas (oldest
        first; those the scaler did not ask for count from now), and the cold start of each
        replica that became ready since the last read."""
        now = time.monotonic()
        asked = self._asked.setdefault(deployment, [])
        asked.extend([now] * (replicas - len(asked)))
        del asked[replicas:]
        before = self._status.get(deployment)
        if before is not None:
            self._cold_starts.extend(now - t for t in asked[before[1]:min(ready, len(asked))])
        self._status[deployment] = (replicas, ready)

    async def observe(self, deployments: list[str]) -> None:
        for deployment in set(deployments) | set(self._wanted):
            try:
                body = await self._request("GET", self._deployment_url(deployment))
            except KubernetesApiError as exc:
                if exc.status == 404:  # not in this cluster: it holds none
                    self._status[deployment] = (0, 0)
                else:  # unreachable: keep the last read; scaling here will tell
                    log.warning("kubernetes status read failed", deployment=deployment, error=str(exc))
                continue
            self._note_status(deployment, int(body.get("spec", {}).get("replicas") or 0),
                              int(body.get("status", {}).get("readyReplicas") or 0))

    def _ready(self, deployment: str) -> int:
        return self._status.get(deployment, (0, 0))[1]

    def set_capacity(self, replicas: int) -> None:
        """Placement keeps within it; the cluster's quota and GPUs are what refuse."""

    def alive(self) -> int:
        return sum(replicas for replicas, _ in self._status.values())

    def held(self, deployment: str, revision: int) -> Held:
        """The Deployment's ready pods, counted to its revisions oldest first (the cluster rolls
        one Deployment; which revision a pod serves is its own business)."""
        ready = self._ready(deployment)
        for rev, n in sorted(self._wanted.get(deployment, {}).items()):
            mine = min(n, ready)
            if rev == revision:
                return Held(ready=mine, starting=n - mine)
            ready -= mine
        return Held()

    async def scale(self, deployment: str, revision: int, spec: DeploymentSpec, replicas: int,
                    loads: dict[str, int]) -> None:
        wanted = self._wanted.setdefault(deployment, {})
        wanted[revision] = replicas
        if replicas == 0:
            wanted.pop(revision)
        total = sum(wanted.values())
        if deployment not in self._status:
            await self.observe([deployment])
        current, ready = self._status.get(deployment, (0, 0))
        if current != total:
            try:
                await self._request("PATCH", self._url(deployment), {"spec": {"replicas": total}})
            except KubernetesApiError as exc:
                raise PoolRefused(str(exc), held=self._held_ready()) from None
            log.info("kubernetes deployment scaled", deployment=f"{self.prefix}{deployment}", replicas=total,
                     was=current, api=self.api_url)
            self._note_status(deployment, total, ready)
        asked = self._asked.get(deployment, [])
        if ready < len(asked) and time.monotonic() - asked[ready] > self.pending_timeout_s:
            raise PoolRefused(f"{len(asked) - ready} pods of {self.prefix}{deployment} not ready after "
                              f"{self.pending_timeout_s:g}s (no room in the cluster)", held=self._held_ready())

    def _held_ready(self) -> int:
        return sum(ready for _, ready in self._status.values())

    def starting(self, deployment: str, revision: int, ready: int) -> int:
        return max(self._wanted.get(deployment, {}).get(revision, 0) - ready, 0)

    def note_ready(self, replica_id: str) -> float | None:
        return None  # pods start without us: the Deployment's status measures the cold start

    def take_cold_starts(self) -> list[float]:
        taken, self._cold_starts = self._cold_starts, []
        return taken

    def revisions(self, deployment: str) -> set[int]:
        return set(self._wanted.get(deployment, {}))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def pool_actuator(spec: PoolSpec, nats_url: str, redis_url: str, log_dir: Path,
                  extra_args: list[str] | None = None, engine_env: dict[str, str] | None = None,
                  cores: CoreShares | None = None) -> Actuator:
    """The actuator of one capacity pool: its cluster's Kubernetes API, or engine processes on
    this machine limited to the pool's capacity (sharing `cores` with the machine's other
    local pools)."""
    a = spec.actuator
    if a.kind == "local":
        return LocalProcessActuator(nats_url, redis_url, log_dir, list(extra_args or []), capacity=spec.capacity,
                                    pool=spec.name, region=spec.region, engine_env=dict(engine_env or {}),
                                    cores=cores if cores is not None else CoreShares())
    return KubernetesActuator(a.api_url, a.namespace, a.deployment_prefix, a.token, pending_timeout_s=a.pending_timeout_s,
                              ca_file=a.ca_file, token_file=a.token_file)
