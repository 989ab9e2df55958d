"""python -m services.engine --model DIR --replica-id ID [--deployment NAME] [engine args]"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys

from services.engine.config import EngineArgs
from services.engine.service import EngineWorker, WorkerConfig
from shared import protocol
from shared import aio, telemetry
from shared.logging import configure_logging
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.engine", description="Strata engine worker")
    p.add_argument("--replica-id", default=f"{socket.gethostname()}-{os.getpid()}")
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


def engine_flags(engine: dict) -> list[str]:
    """The flags that give this worker a deployment spec's engine arguments."""
    return EngineArgs.cli_flags(engine)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.from_args(args)
    configure_logging("engine", settings.log_format, settings.log_level)
    if not settings.model:
        print("--model (or STRATA_MODEL) is required", file=sys.stderr)
        return 2
    if not settings.nats_url or not settings.redis_url:
        print("--nats-url and --redis-url (or STRATA_NATS_URL / STRATA_REDIS_URL) are required; "
              "`strata up` starts a local stack", file=sys.stderr)
        return 2
    engine_args = dataclasses.asdict(EngineArgs.from_cli_args(args))
    cfg = WorkerConfig(model_dir=settings.model, replica_id=args.replica_id,
                       deployment=args.deployment or protocol.served_model_name(settings.model), revision=args.revision,
                       nats_url=settings.nats_url, redis_url=settings.redis_url, http_host=args.http_host,
                       http_port=args.http_port, lease_ttl=args.lease_ttl, heartbeat_interval=args.heartbeat_interval,
                       drain_timeout=args.drain_timeout, engine_args=engine_args, region=settings.region,
                       pool=args.pool, nats_auth=settings.nats_auth())

    exit_code = [0]

    async def run() -> None:
        worker = EngineWorker(cfg)
        await worker.start()
        await worker.run()
        exit_code[0] = worker.exit_code

    aio.run(telemetry.observed("engine", args.replica_id, settings.nats_url, run(), settings.nats_auth()))
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())
