"""The `strata` command line."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from shared.settings import Settings


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from shared.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed,
                          max_position=args.max_position, tie_embeddings=args.tie_embeddings)
    print(f"tiny model written to {out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from shared.localstack import LocalStack
    from shared.logging import configure_logging
    from shared.tiny_model import ensure_tiny_model

    settings = Settings.from_args(args)
    configure_logging("up", settings.log_format, settings.log_level)
    model_dir = settings.model or str(ensure_tiny_model(settings.tiny_model_dir))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = LocalStack(model_dir, engines=args.engines, port=args.port, nats_url=settings.nats_url,
                       redis_url=settings.redis_url, api_key=settings.api_key,
                       log_dir=settings.home / "logs")
    with stack:
        print(f"strata is up\n"
              f"  base url: {stack.base_url}/v1\n"
              f"  api key:  {stack.api_key}\n"
              f"  model:    {stack.deployment} ({model_dir})\n"
              f"  engines:  {args.engines}\n"
              f"  nats:     {stack.infra.nats_url}\n"
              f"  redis:    {stack.infra.redis_url}\n"
              f"  logs:     {stack.log_dir}\n"
              f"Ctrl-C stops everything.", flush=True)
        stop.wait()
        print("stopping", flush=True)
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    import asyncio

    from services.gateway.auth import create_key
    from shared.store import connect_redis

    settings = Settings.from_args(args)
    if not settings.redis_url:
        print("--redis-url (or STRATA_REDIS_URL) is required", file=sys.stderr)
        return 2

    async def create() -> str:
        redis = connect_redis(settings.redis_url)
        try:
            return await create_key(redis, args.name, rpm=args.rpm, tpm=args.tpm, priority=args.priority)
        finally:
            await redis.aclose()

    print(asyncio.run(create()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: LLM inference stack")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a small random Llama model with a trained tokenizer")
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-position", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-embeddings", action="store_true")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("up", help="run the whole stack on this machine (no Docker)")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--port", type=int, default=8000)
    Settings.add_arguments(p)
    p.set_defaults(func=cmd_up)

    keys_parser = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys_parser.add_subparsers(dest="keys_command", required=True)
    p = keys_sub.add_parser("create", help="create an API key and print it (only its hash is stored)")
    p.add_argument("--name", required=True, help="tenant name")
    p.add_argument("--rpm", type=int, default=0, help="requests per minute (0: unlimited)")
    p.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: unlimited)")
    p.add_argument("--priority", default="standard", choices=["critical", "standard", "sheddable"])
    Settings.add_arguments(p)
    p.set_defaults(func=cmd_keys_create)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
