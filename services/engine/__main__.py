"""python -m services.engine --model DIR --replica-id ID [--deployment NAME] [engine args]"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from services.engine.config import EngineArgs, EngineArgsError
from shared import protocol
from shared.service_main import UsageError, service_main, service_parser
from shared.settings import Settings


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    p = service_parser("engine", "Strata engine worker", "replica-id", exit_on_error=exit_on_error)
    p.add_argument("--deployment", default="", help="served model name (default: the model directory's name)")
    p.add_argument("--revision", type=int, default=0, help="deployment revision served (0: not managed by control)")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0, help="/metrics and /health (0: any free port)")
    p.add_argument("--lease-ttl", type=float, default=5.0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--pool", default=os.environ.get("STRATA_POOL", ""),
                   help="the capacity pool that runs this engine (env STRATA_POOL; set by the scaler's pools)")
    EngineArgs.add_cli_args(p)
    Settings.add_arguments(p)
    return p


def make_worker(args: argparse.Namespace, settings: Settings):
    if not settings.model:
        raise UsageError("--model (or STRATA_MODEL) is required")
    try:
        engine_args = dataclasses.asdict(EngineArgs.from_cli_args(args))
    except EngineArgsError as exc:
        raise UsageError(f"engine arguments: {exc}") from None
    from services.engine.service import EngineWorker, WorkerConfig  # the runtime: torch and the model

    return EngineWorker(WorkerConfig(
        model_dir=settings.model, replica_id=args.replica_id,
        deployment=args.deployment or protocol.served_model_name(settings.model), revision=args.revision,
        nats_url=settings.nats_url, redis_url=settings.redis_url, http_host=args.http_host, http_port=args.http_port,
        lease_ttl=args.lease_ttl, heartbeat_interval=args.heartbeat_interval, drain_timeout=args.drain_timeout,
        engine_args=engine_args, region=settings.region, pool=args.pool, nats_auth=settings.nats_auth()))


def main(argv=None) -> int:
    return service_main("engine", build_parser(), "replica-id", make_worker, argv)


if __name__ == "__main__":
    sys.exit(main())
