"""python -m services.engine --model DIR --replica-id ID [--deployment NAME] [engine args]"""

from __future__ import annotations

import argparse
import os
import socket
import sys

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
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--device", default="cpu")
    e.add_argument("--attention-backend", default="auto")
    e.add_argument("--threads", type=int, default=0, help="torch threads for the model (0: torch's default)")
    e.add_argument("--debug-step-delay", type=float, default=0.0, help="test only: slow every step down")
    Settings.add_arguments(p)
    return p


def engine_flags(engine: dict) -> list[str]:
    """The flags that give this worker a deployment spec's engine arguments (see
    services.control.spec.ENGINE_ARGS for the names)."""
    flags = []
    for name, value in engine.items():
        if name == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        else:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


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
    engine_args = dict(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                       enable_prefix_caching=not args.no_prefix_caching, dtype=args.dtype, device=args.device,
                       attention_backend=args.attention_backend, debug_step_delay_s=args.debug_step_delay,
                       num_threads=args.threads)
    cfg = WorkerConfig(model_dir=settings.model, replica_id=args.replica_id,
                       deployment=args.deployment or protocol.served_model_name(settings.model), revision=args.revision,
                       nats_url=settings.nats_url, redis_url=settings.redis_url, http_host=args.http_host,
                       http_port=args.http_port, lease_ttl=args.lease_ttl, heartbeat_interval=args.heartbeat_interval,
                       drain_timeout=args.drain_timeout, engine_args=engine_args, nats_auth=settings.nats_auth())

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
