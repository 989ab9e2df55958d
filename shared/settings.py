"""Settings from the environment, overridable by command-line flags.

Every variable is `STRATA_<NAME>`; a flag `--<name>` (dashes for underscores) given to a service
wins over the environment. Empty URLs mean "start the embedded server" (see shared.localstack).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path


def default_home() -> Path:
    return Path(os.environ.get("STRATA_HOME", Path.home() / ".strata"))


@dataclass
class Settings:
    nats_url: str = ""
    redis_url: str = ""
    home: Path = field(default_factory=default_home)
    model: str = ""  # model directory; empty = the tiny model under home
    log_format: str = "auto"  # json | console | auto (json unless stderr is a terminal)
    log_level: str = "info"
    api_key: str = ""
    region: str = ""  # where this service runs: engines report it, gateways stamp it on requests,
    # schedulers prefer replicas in the request's region (empty: no region, every replica is near)
    # NATS: credentials of this service's role (shared.nats_auth), TLS. nats_url may list several.
    nats_user: str = ""
    nats_password: str = ""
    nats_creds: str = ""  # a NATS credentials file (JWT + nkey seed) instead of user and password
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""

    def nats_auth(self):
        from shared.bus import NatsAuth

        return NatsAuth.from_settings(self)

    @property
    def tiny_model_dir(self) -> Path:
        return self.home / "models" / "tiny-llama"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f"STRATA_{f.name.upper()}")
            if raw is not None:
                values[f.name] = Path(raw) if f.name == "home" else raw
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Flags for every setting; their default is None so that unset flags keep the env value."""
        for f in dataclasses.fields(cls):
            parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f"settings_{f.name}", default=None,
                                help=f"(env STRATA_{f.name.upper()})")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> "Settings":
        settings = cls.from_env(environ)
        for f in dataclasses.fields(cls):
            value = getattr(args, f"settings_{f.name}", None)
            if value is not None:
                setattr(settings, f.name, Path(value) if f.name == "home" else value)
        return settings
