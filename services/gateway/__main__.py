"""python -m services.gateway --model DIR [--model DIR ...] [--port 8000] --nats-url URL --redis-url URL"""

from __future__ import annotations

import argparse
import sys

from services.gateway.choices import MAX_N_DEFAULT
from services.gateway.service import GatewayConfig, GatewayService
from services.gateway.tool_parsers import TOOL_PARSERS, UnknownToolParser, parser_class
from shared.http_limits import HttpLimits
from shared.service_main import UsageError, service_main, service_parser
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("gateway", "Strata OpenAI-compatible gateway", "gateway-id")
    p.add_argument("--serve", action="append", default=[], metavar="DIR",
                   help="a model directory to serve (repeatable; default: --model)")
    p.add_argument("--served-model-name", action="append", default=[])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--no-auth", action="store_true", help="development only: accept requests without a key")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="default deadline of a request, seconds (headers Strata-Timeout / Strata-Deadline shorten it)")
    p.add_argument("--max-inflight", type=int, default=256,
                   help="requests served at once; past it new ones get 503 with Retry-After before any work")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="max_tokens of chat requests that give none (a deployment's limits.default_max_tokens wins)")
    p.add_argument("--tool-call-parser", action="append", default=[], metavar="[MODEL=]PARSER",
                   help=f"how tool_choice 'auto' reads tool calls from the output of the models served here "
                        f"({', '.join(TOOL_PARSERS)}): one for every --serve model, or MODEL=PARSER for one "
                        f"(repeatable); a deployment's spec has its own tool_call_parser")
    p.add_argument("--max-n", type=int, default=MAX_N_DEFAULT,
                   help="choices per prompt a request may ask for (n, best_of); more is a 400 naming the field")
    limits = p.add_argument_group("HTTP limits")
    defaults = HttpLimits()
    limits.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                        help="seconds for a request's line and headers, from its first byte")
    limits.add_argument("--body-timeout", type=float, default=defaults.body_timeout,
                        help="seconds for a request's body (408 past it)")
    limits.add_argument("--write-timeout", type=float, default=defaults.write_timeout,
                        help="seconds a client may stop reading its stream before it is dropped")
    limits.add_argument("--keepalive-timeout", type=float, default=defaults.keepalive_timeout,
                        help="seconds an idle keep-alive connection stays open")
    limits.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections; more are answered 503 and closed")
    Settings.add_arguments(p)
    return p


def parse_tool_call_parsers(values: list[str]) -> dict[str, str]:
    """--tool-call-parser values: served name -> parser ("" for every model)."""
    out: dict[str, str] = {}
    for value in values:
        model, _, parser = value.rpartition("=")
        parser_class(parser)  # raises UnknownToolParser naming it
        if model in out:
            raise ValueError(f"two parsers for {model or 'every model'}")
        out[model] = parser
    return out


def make_gateway(args: argparse.Namespace, settings: Settings) -> GatewayService:
    # Models: the directories given here, plus every deployment control stores.
    models = args.serve or ([settings.model] if settings.model else [])
    if args.max_inflight < 1 or args.default_max_tokens < 1 or args.max_connections < 1 or args.max_n < 1:
        raise UsageError("--max-inflight, --default-max-tokens, --max-connections and --max-n must be at least 1")
    try:
        tool_call_parsers = parse_tool_call_parsers(args.tool_call_parser)
    except (UnknownToolParser, ValueError) as exc:
        raise UsageError(f"--tool-call-parser: {exc}") from None
    http = HttpLimits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                      write_timeout=args.write_timeout, keepalive_timeout=args.keepalive_timeout,
                      max_connections=args.max_connections)
    return GatewayService(GatewayConfig(
        settings.nats_url, settings.redis_url, models, args.served_model_name, args.host, args.port, args.gateway_id,
        not args.no_auth, args.request_timeout, region=settings.region, max_inflight=args.max_inflight,
        default_max_tokens=args.default_max_tokens, max_n=args.max_n, http=http, nats_auth=settings.nats_auth(),
        tool_call_parsers=tool_call_parsers))


def main(argv=None) -> int:
    return service_main("gateway", build_parser(), "gateway-id", make_gateway, argv)


if __name__ == "__main__":
    sys.exit(main())
