"""compose.yaml: valid against the Compose Specification's JSON schema, and a stack that starts in
order, with every service healthy, traced and scraped. No Docker engine is needed (or run)."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from tests.deploy.manifests import (
    HTTP_PORT_FLAG,
    PROMETHEUS_FILE,
    ROOT,
    compose_commands,
    duration_seconds,
    health_url_port,
    load_compose,
)

SCHEMA_FILE = Path(__file__).with_name("schemas") / "compose-spec.json"


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_matches_the_compose_specification(compose, validator):
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_the_schema_rejects_what_compose_would(compose, validator):
    """The vendored schema is not vacuous: a misspelt key and a bad depends_on condition fail."""
    typo = copy.deepcopy(compose)
    typo["services"]["gateway"]["helthcheck"] = typo["services"]["gateway"].pop("healthcheck")
    assert not validator.is_valid(typo)
    bad_condition = copy.deepcopy(compose)
    bad_condition["services"]["gateway"]["depends_on"]["nats"]["condition"] = "service_ready"
    assert not validator.is_valid(bad_condition)


def test_every_service_has_a_healthcheck(compose):
    for name, service in compose["services"].items():
        check = service.get("healthcheck")
        assert check and not check.get("disable"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, name


def test_services_start_in_order_of_health(compose):
    services = compose["services"]
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: depends_on must name a condition for each dependency"
        for dep, spec in depends_on.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert spec["condition"] == "service_healthy", f"{name} -> {dep}: {spec}"
            assert "healthcheck" in services[dep], f"{name} waits for the health of {dep}, which has no check"
            # A service outside any profile cannot wait for one that is only in a profile.
            assert not services[dep].get("profiles") or service.get("profiles"), f"{name} -> {dep}"
    # The dependency graph has an order (no cycle).
    remaining = {name: set(service.get("depends_on", {})) for name, service in services.items()}
    while remaining:
        ready = [name for name, deps in remaining.items() if not deps & set(remaining)]
        assert ready, f"dependency cycle among {sorted(remaining)}"
        for name in ready:
            del remaining[name]


def test_strata_services_wait_for_nats_redis_and_jaeger(compose):
    for command in compose_commands():
        name = command.where.removeprefix("compose:")
        assert {"nats", "redis", "jaeger"} <= set(compose["services"][name]["depends_on"]), name


def test_nats_runs_jetstream_with_monitoring(compose):
    argv = compose["services"]["nats"]["command"]
    assert "-js" in argv and argv[argv.index("-m") + 1] == "8222"


def test_each_service_checks_its_own_health_endpoint(compose):
    """The healthcheck fetches /health on the port the service's own flags give it."""
    for command in compose_commands():
        name = command.where.removeprefix("compose:")
        port = getattr(command.parse(), HTTP_PORT_FLAG[command.module])
        assert health_url_port(compose["services"][name]["healthcheck"]["test"]) == port, name


def test_engines_come_in_a_cpu_and_a_gpu_profile(compose):
    engines = {c.where.removeprefix("compose:"): c for c in compose_commands() if c.module == "engine"}
    by_profile = {tuple(compose["services"][name].get("profiles", [])): name for name in engines}
    assert set(by_profile) == {("cpu",), ("gpu",)}
    cpu, gpu = by_profile[("cpu",)], by_profile[("gpu",)]
    assert engines[cpu].parse().device == "cpu"
    assert engines[gpu].parse().device == "cuda"
    assert compose["services"][cpu]["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert compose["services"][gpu]["build"]["dockerfile"] == "docker/Dockerfile.cuda"


def test_gpu_profile_reserves_nvidia_devices(compose):
    gpu_services = [s for s in compose["services"].values() if "gpu" in s.get("profiles", [])]
    assert gpu_services
    for service in gpu_services:
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    cpu_only = [s for s in compose["services"].values() if "gpu" not in s.get("profiles", [])]
    assert not any("resources" in s.get("deploy", {}) for s in cpu_only)


def test_engines_are_given_time_to_drain(compose):
    """Compose sends SIGKILL after stop_grace_period (10 s by default); the drain needs its timeout."""
    for command in compose_commands():
        if command.module == "engine":
            service = compose["services"][command.where.removeprefix("compose:")]
            grace = duration_seconds(service.get("stop_grace_period", "10s"))
            assert grace >= command.parse().drain_timeout + 5, command.where


def test_every_strata_service_exports_traces_to_jaeger(compose):
    for command in compose_commands():
        endpoint = urlparse(command.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("jaeger", 4318), command.where


def test_prometheus_scrapes_every_strata_service(compose):
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in \
        compose["services"]["prometheus"]["volumes"]
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    static, dns, discovered = set(), set(), {}
    for job in config["scrape_configs"]:
        for group in job.get("static_configs", []):
            static.update(group["targets"])
        for sd in job.get("dns_sd_configs", []):
            dns.update(f"{name}:{sd['port']}" for name in sd["names"])
        for sd in job.get("http_sd_configs", []):
            discovered[job["job_name"]] = urlparse(sd["url"])
    # Engines, wherever they run (these services' replicas, and those the scaler starts on ports
    # of its own choosing), come from control's service discovery (tests/control/test_metrics.py
    # reads it live): it must point at control's port and path.
    control = next(c for c in compose_commands() if c.module == "control")
    sd = discovered["engine"]
    assert (sd.hostname, sd.port, sd.path) == ("control", control.parse().port, "/prometheus/targets"), sd
    scaler = next(c for c in compose_commands() if c.module == "scaler").parse()
    assert "--http-host=0.0.0.0" in scaler.engine_arg, "engines the scaler starts must be reachable"
    for command in compose_commands():
        name = command.where.removeprefix("compose:")
        if command.module == "engine":
            assert command.parse().http_host == "0.0.0.0", f"{name}: reachable at the host name it advertises"
            continue
        target = f"{name}:{getattr(command.parse(), HTTP_PORT_FLAG[command.module])}"
        replicated = compose["services"][name].get("deploy", {}).get("replicas", 1) > 1
        # A service of several replicas, or one only in a profile, is found through DNS.
        expected = dns if replicated or compose["services"][name].get("profiles") else static
        assert target in expected, f"prometheus does not scrape {target}"
    for target in static | dns:
        host = target.rsplit(":", 1)[0]
        assert host == "localhost" or host in compose["services"], f"scrape target {target} is no service"
    assert config["rule_files"] == ["alerts.yml"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]


def test_grafana_is_provisioned_in_its_own_profile(compose):
    """Grafana runs only with `--profile grafana` (never with cpu/gpu alone) and gets the three
    dashboards and Prometheus as its data source from deploy/grafana."""
    grafana = compose["services"]["grafana"]
    assert grafana["profiles"] == ["grafana"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in grafana["volumes"]}
    provisioning, dashboards = mounts["/etc/grafana/provisioning"], mounts["/var/lib/grafana/dashboards/strata"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert urlparse(datasource["url"]).hostname == "prometheus" and datasource["type"] == "prometheus"
    provider = yaml.safe_load((provisioning / "dashboards" / "strata.yaml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/strata"
    assert sorted(p.name for p in dashboards.glob("*.json")) == ["infrastructure.json", "runtime.json", "tooling.json"]


def test_images_bake_the_model_the_services_serve(compose):
    """The tiny model each Dockerfile builds is the one every command and STRATA_MODEL names."""
    for dockerfile in ("docker/Dockerfile.cpu", "docker/Dockerfile.cuda"):
        text = (ROOT / dockerfile).read_text()
        baked = re.search(r"strata make-tiny-model (\S+)", text).group(1)
        assert f"STRATA_MODEL={baked}" in text, dockerfile
        for command in compose_commands():
            assert command.environ["STRATA_MODEL"] == baked, command.where
            if command.module in ("engine", "gateway"):
                assert command.parse().settings_model == baked, command.where


def test_images_pin_the_projects_torch():
    pyproject = (ROOT / "pyproject.toml").read_text()
    pinned = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    for dockerfile in ("docker/Dockerfile.cpu", "docker/Dockerfile.cuda"):
        assert re.findall(r"pip install torch==([\w.]+)", (ROOT / dockerfile).read_text()) == [pinned], dockerfile


def _package_data_covers(path: Path, package_data: dict[str, list[str]]) -> bool:
    """setuptools' package-data rule for the forms pyproject.toml uses: a package name, and globs
    relative to that package's directory in which `*` stays within one path segment."""
    for package, globs in package_data.items():
        package_dir = ROOT / package.replace(".", "/")
        if not path.is_relative_to(package_dir):
            continue
        relative = path.relative_to(package_dir).as_posix()
        for glob in globs:
            assert "**" not in glob and package not in ("", "*"), f"package-data form not handled: {package}: {glob}"
            if fnmatch.fnmatch(relative, glob) and relative.count("/") == glob.count("/"):
                return True
    return False


def test_images_install_every_file_the_code_reads():
    """The images `pip install .` (no source tree at run time): a file that is not a Python module
    reaches them only as package data. Without it the CPU kernel source or the dashboard would be
    missing in the containers while every test run from the checkout passes."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = config.get("package-data", {})
    missing = [path.relative_to(ROOT).as_posix()
               for top in config["packages"]["find"]["include"]
               for path in sorted((ROOT / top.rstrip("*")).rglob("*"))
               if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
               and not _package_data_covers(path, package_data)]
    assert not missing, f"not in [tool.setuptools.package-data], so not in the images: {missing}"
