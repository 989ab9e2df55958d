"""Every service command in compose.yaml and deploy/k8s is one the local stack runs: the same
`python -m services.<name>` modules, accepted by each service's own argument parser, with the
settings the service refuses to start without."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from shared.settings import Settings
from tests.deploy.manifests import (
    HTTP_HOST_FLAG,
    K8S_VARIANTS,
    all_commands,
    compose_commands,
    k8s_commands,
    load_compose,
    local_stack_modules,
    render_k8s,
)

COMMANDS = all_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_parses_with_the_services_own_parser(command):
    try:
        command.parse()
    except SystemExit as exc:  # argparse prints the reason to stderr
        pytest.fail(f"{command.where}: `{' '.join(command.argv)}` rejected by services.{command.module} ({exc})")


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_has_the_settings_its_service_requires(command):
    settings = Settings.from_args(command.parse(), environ=command.environ)
    assert settings.nats_url.startswith("nats://") and settings.redis_url.startswith("redis://"), command.where
    if command.module in ("engine", "gateway"):
        assert settings.model, command.where


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_serves_http_beyond_the_container(command):
    """A server bound to the loopback address inside a container is unreachable from outside it."""
    if command.module in HTTP_HOST_FLAG:
        assert getattr(command.parse(), HTTP_HOST_FLAG[command.module]) == "0.0.0.0", command.where


def test_the_modules_are_the_local_stacks():
    """Compose and Kubernetes run exactly the services the local stack starts."""
    local = local_stack_modules()
    assert {"engine", "gateway", "scheduler"} <= local, local
    assert {c.module for c in compose_commands()} == local
    for variant in K8S_VARIANTS:
        assert {c.module for c in k8s_commands(variant)} == local, variant


def test_urls_name_the_infrastructure_services():
    compose_services = set(load_compose()["services"])
    for command in compose_commands():
        settings = Settings.from_args(command.parse(), environ=command.environ)
        for url in (settings.nats_url, settings.redis_url):
            assert urlparse(url).hostname in compose_services, (command.where, url)
    for variant in K8S_VARIANTS:
        k8s_services = {o["metadata"]["name"] for o in render_k8s(variant) if o["kind"] == "Service"}
        for command in k8s_commands(variant):
            settings = Settings.from_args(command.parse(), environ=command.environ)
            for url in (settings.nats_url, settings.redis_url):
                assert urlparse(url).hostname in k8s_services, (command.where, url)
