"""python -m services.control --nats-url URL --redis-url URL [--host H] [--port 8081]"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from services.control.service import ControlConfig, ControlService
from shared import aio, telemetry
from shared.logging import configure_logging
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.control",
                                description="Strata control plane: deployments API and dashboard")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--control-id", default=f"{socket.gethostname()}-{os.getpid()}")
    Settings.add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.from_args(args)
    configure_logging("control", settings.log_format, settings.log_level)
    if not settings.nats_url or not settings.redis_url:
        print("--nats-url and --redis-url are required", file=sys.stderr)
        return 2
    service = ControlService(ControlConfig(settings.nats_url, settings.redis_url, args.host, args.port,
                                           args.control_id, nats_auth=settings.nats_auth()))
    aio.run(telemetry.observed("control", args.control_id, settings.nats_url, aio.serve_until_signalled(service),
                               settings.nats_auth()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
