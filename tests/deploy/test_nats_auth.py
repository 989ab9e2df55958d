"""The NATS users of compose and Kubernetes are shared/nats_auth.py's: the server's authorization
block is the generated one (and nats-server accepts it), and every Strata service connects as
its own role, with its role's password and no other."""

from __future__ import annotations

import re
import subprocess

from shared.localstack import nats_server_binary
from shared.nats_auth import CONFIG_HEADER, SERVICE_ROLES, new_users, password_variable, render_config
from tests.deploy.manifests import ROOT, compose_commands, find, load_compose, render_k8s, workloads

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
