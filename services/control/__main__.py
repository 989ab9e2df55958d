"""python -m services.control --nats-url URL --redis-url URL [--host H] [--port 8081]"""

from __future__ import annotations

import argparse
import sys

from services.control.service import ControlConfig, ControlService
from shared.service_main import service_main, service_parser
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("control", "Strata control plane: deployments API and dashboard", "control-id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    Settings.add_arguments(p)
    return p


def make_control(args: argparse.Namespace, settings: Settings) -> ControlService:
    return ControlService(ControlConfig(settings.nats_url, settings.redis_url, args.host, args.port, args.control_id,
                                        nats_auth=settings.nats_auth()))


def main(argv=None) -> int:
    return service_main("control", build_parser(), "control-id", make_control, argv)


if __name__ == "__main__":
    sys.exit(main())
