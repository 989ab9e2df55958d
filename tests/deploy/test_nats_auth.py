"""The NATS users of compose (compose.yaml, and merged with compose.host.yaml as Docker Compose
merges them) and Kubernetes are shared/nats_auth.py's: the server runs the generated
authorization block (and nats-server accepts it), and every Strata service connects as its own
role, with its role's password and no other."""

from __future__ import annotations

import re
import subprocess

import pytest

from shared.localstack import nats_server_binary
from shared.nats_auth import CONFIG_HEADER, SERVICE_ROLES, new_users, password_variable, render_config
from tests.deploy.dockerhost import HOST_OVERRIDE, ComposeProject
from tests.deploy.manifests import COMPOSE_FILE, ROOT, compose_commands, find, load_compose, render_k8s, workloads

NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"


def test_the_server_config_is_the_generated_one():
    assert NATS_CONF.read_text() == CONFIG_HEADER + render_config(new_users(), password_vars=True), \
        "regenerate it: python -m shared.nats_auth > deploy/nats/nats.conf"
    configmap = find(render_k8s("base"), "ConfigMap", "nats-config")
    assert configmap["data"]["nats.conf"] == NATS_CONF.read_text()


def test_nats_server_accepts_it_with_the_passwords_and_refuses_it_without(tmp_path):
    passwords = {password_variable(user): f"pw-{user}" for user in new_users()}
    ok = subprocess.run([nats_server_binary(), "-t", "-c", str(NATS_CONF)], env=passwords, capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run([nats_server_binary(), "-t", "-c", str(NATS_CONF)], env={}, capture_output=True,
                             text=True)
    assert missing.returncode != 0 and "STRATA_NATS_PASSWORD" in missing.stderr


def _variable(value: str) -> str:
    """The variable a compose value `${NAME:-default}` reads."""
    match = re.fullmatch(r"\$\{(\w+)(:-[^}]*)?\}", value)
    assert match, value
    return match.group(1)


def test_compose_gives_each_service_its_roles_credentials():
    compose = load_compose()
    server = compose["services"]["nats"]["environment"]
    assert {password_variable(u) for u in new_users()} == set(server)
    for command in compose_commands():
        role = command.module
        assert role in SERVICE_ROLES
        assert command.environ["STRATA_NATS_USER"] == role, command.where
        assert _variable(command.environ["STRATA_NATS_PASSWORD"]) == password_variable(role), command.where
        # The same variable, with the same trial default, on both sides.
        assert command.environ["STRATA_NATS_PASSWORD"] == server[password_variable(role)], command.where


def _mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's volumes, in the short (compose.yaml) or the long syntax
    (`docker compose config`)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        out[target] = source
    return out


@pytest.fixture(scope="module", params=["compose.yaml", "compose.yaml + compose.host.yaml"])
def merged_config(request) -> dict:
    """The configuration as Docker Compose reads it (variables filled in, overrides merged)."""
    files = [COMPOSE_FILE] if request.param == "compose.yaml" else [COMPOSE_FILE, HOST_OVERRIDE]
    return ComposeProject("strata-nats-auth", files, ["cpu"]).config()


def test_every_compose_variant_runs_nats_with_the_users_and_each_service_as_its_role(merged_config):
    services = merged_config["services"]
    argv = services["nats"]["command"]
    assert argv[argv.index("-c") + 1] == "/etc/nats/nats.conf", argv
    assert _mounts(services["nats"])["/etc/nats/nats.conf"] in ("./deploy/nats/nats.conf", str(NATS_CONF))
    server = services["nats"]["environment"]
    assert set(server) >= {password_variable(u) for u in new_users()}
    commands = compose_commands(merged_config)
    assert {c.module for c in commands} == set(SERVICE_ROLES)
    for command in commands:
        role = command.module
        assert command.environ["STRATA_NATS_USER"] == role, command.where
        assert command.environ["STRATA_NATS_PASSWORD"] == server[password_variable(role)], command.where
    scaler = next(c for c in commands if c.module == "scaler")  # the engines it starts connect as engines
    assert scaler.environ["STRATA_ENGINE_NATS_USER"] == "engine"
    assert scaler.environ["STRATA_ENGINE_NATS_PASSWORD"] == server[password_variable("engine")]


def test_every_compose_variant_keeps_valkey_data_with_aof(merged_config):
    redis = merged_config["services"]["redis"]
    argv = redis["command"]
    assert argv[argv.index("--appendonly") + 1] == "yes" and argv[argv.index("--appendfsync") + 1] == "everysec"
    assert argv[argv.index("--dir") + 1] in _mounts(redis), "the AOF directory must be a volume"


def test_kubernetes_keeps_valkey_data_with_aof():
    deployment = find(render_k8s("base"), "Deployment", "redis")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv[argv.index("--appendonly") + 1] == "yes"
    assert argv[argv.index("--dir") + 1] in {m["mountPath"] for m in container["volumeMounts"]}


def test_kubernetes_gives_each_service_its_roles_credentials():
    objects = render_k8s("base")
    secret = find(objects, "Secret", "strata-nats")
    assert set(secret["stringData"]) == {password_variable(u) for u in new_users()}
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            argv = [*container.get("command", []), *container.get("args", [])]
            if argv[:2] != ["python", "-m"]:
                continue
            role = argv[2].removeprefix("services.")
            env = {v["name"]: v for v in container.get("env", [])}
            assert env["STRATA_NATS_USER"]["value"] == role, workload["metadata"]["name"]
            ref = env["STRATA_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "strata-nats", "key": password_variable(role)}, workload["metadata"]["name"]
