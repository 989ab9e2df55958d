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


# ---- observability: strata logs, strata diagnose ------------------------------------------------
def _duration(text: str) -> float:
    """'90', '90s', '5m', '2h' -> seconds (an argparse type)."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    try:
        return float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 5m, 1h)") from None


def cmd_logs(args: argparse.Namespace) -> int:
    import asyncio

    from services.control.logs import follow, render

    settings = Settings.from_args(args)
    if not settings.nats_url:
        print("--nats-url (or STRATA_NATS_URL) is required", file=sys.stderr)
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await follow(settings.nats_url, lambda line: print(render(line, args.json), flush=True), stop,
                     service=args.service, request_id=args.request, since=args.since)

    asyncio.run(run())
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from services.control.diagnose import Thresholds, diagnose, render
    from services.control.figures import gather

    settings = Settings.from_args(args)
    if not settings.redis_url:
        print("--redis-url (or STRATA_REDIS_URL) is required: services are found through the registry",
              file=sys.stderr)
        return 2
    figures = asyncio.run(gather(settings.redis_url, args.since, args.gateway_url))
    if args.deployment:
        figures.deployments = [d for d in figures.deployments if d.name == args.deployment]
    report = diagnose(figures, Thresholds(itl_slo_s=args.itl_slo))
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 0


def _add_observability_commands(sub) -> None:
    p = sub.add_parser("logs", help="follow the services' log lines live (over NATS)")
    p.add_argument("--service", choices=["gateway", "scheduler", "engine", "scaler", "control"])
    p.add_argument("--request", metavar="ID", help="only the lines of this request id")
    p.add_argument("--since", type=_duration, default=0.0, metavar="DURATION",
                   help="start this far back, e.g. 5m (replayed from JetStream), then follow")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    Settings.add_arguments(p)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("diagnose", help="which layer owns the current latency, with evidence and the usual fix")
    p.add_argument("--since", type=_duration, default=300.0, metavar="DURATION",
                   help="the window to look at (default 5m; 0: since the services started)")
    p.add_argument("--deployment", help="only this deployment")
    p.add_argument("--gateway-url", action="append", default=[],
                   help="a gateway's base URL, if it is not registered in Redis (repeatable)")
    p.add_argument("--itl-slo", type=float, default=0.05, metavar="SECONDS",
                   help="inter-token latency above this is slow (default 0.05)")
    p.add_argument("--json", action="store_true")
    Settings.add_arguments(p)
    p.set_defaults(func=cmd_diagnose)


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
    _add_observability_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
