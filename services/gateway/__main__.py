"""python -m services.gateway --model DIR [--model DIR ...] [--port 8000] --nats-url URL --redis-url URL"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from services.gateway.service import GatewayConfig, GatewayService
from shared import aio, telemetry
from shared.logging import configure_logging
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description="Strata OpenAI-compatible gateway")
    p.add_argument("--serve", action="append", default=[], metavar="DIR",
                   help="a model directory to serve (repeatable; default: --model)")
    p.add_argument("--served-model-name", action="append", default=[])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gateway-id", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--no-auth", action="store_true", help="development only: accept requests without a key")
    p.add_argument("--request-timeout", type=float, default=600.0)
    Settings.add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.from_args(args)
    configure_logging("gateway", settings.log_format, settings.log_level)
    models = args.serve or ([settings.model] if settings.model else [])
    if not settings.nats_url or not settings.redis_url:
        # Models: the directories given here, plus every deployment control stores.
        print("--nats-url and --redis-url are required", file=sys.stderr)
        return 2
    cfg = GatewayConfig(settings.nats_url, settings.redis_url, models, args.served_model_name, args.host, args.port,
                        args.gateway_id, not args.no_auth, args.request_timeout, region=settings.region)

    aio.run(telemetry.observed("gateway", args.gateway_id, settings.nats_url,
                               aio.serve_until_signalled(GatewayService(cfg))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
