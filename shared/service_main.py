"""The one entry point of the services (`python -m services.X`): flags and settings, structured
logs, spans and the log stream, start, run until SIGTERM/SIGINT, stop.

Each service's __main__.py gives its parser (service_parser adds the instance id and the
settings flags every service has) and a function making its service from the parsed flags;
that function raises UsageError for a flag it refuses (exit status 2, nothing started).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from typing import Any, Protocol

from shared import aio, telemetry
from shared.logging import configure_logging
from shared.settings import Settings


class UsageError(Exception):
    """A flag or setting the service refuses; the message names it."""


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def service_parser(service: str, description: str, id_flag: str, **kwargs) -> argparse.ArgumentParser:
    """A service's parser with its instance id (`--<id_flag>`, default host-pid); the caller
    adds its own flags, then Settings.add_arguments."""
    p = argparse.ArgumentParser(prog=f"python -m services.{service}", description=description, **kwargs)
    p.add_argument(f"--{id_flag}", default=f"{socket.gethostname()}-{os.getpid()}",
                   help=f"this {service}'s id in logs, metrics and spans (default: host-pid)")
    return p


def service_main(service: str, parser: argparse.ArgumentParser, id_flag: str,
                 make: Callable[[argparse.Namespace, Settings], Any], argv: list[str] | None = None) -> int:
    """Run one service process to its end; returns the exit status. `make(args, settings)`
    returns the service: start() then stop() at SIGTERM/SIGINT, or, when it has run(), start()
    then run() (it handles the signals itself: the engine drains) and its exit_code."""
    args = parser.parse_args(argv)
    settings = Settings.from_args(args)
    configure_logging(service, settings.log_format, settings.log_level)
    try:
        if not settings.nats_url or not settings.redis_url:
            raise UsageError("--nats-url and --redis-url (or STRATA_NATS_URL / STRATA_REDIS_URL) are required; "
                             "`strata up` starts a local stack")
        instance = make(args, settings)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    instance_id = getattr(args, id_flag.replace("-", "_"))
    aio.run(telemetry.observed(service, instance_id, settings.nats_url, _serve(instance), settings.nats_auth()))
    return getattr(instance, "exit_code", 0)


async def _serve(instance) -> None:
    run = getattr(instance, "run", None)
    if run is None:
        await aio.serve_until_signalled(instance)
    else:
        await instance.start()
        await run()
