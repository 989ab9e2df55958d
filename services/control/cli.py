"""The `strata` command line."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from shared.protocol import PRIORITIES
from shared.settings import Settings


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from shared.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed,
                          max_position=args.max_position, tie_embeddings=args.tie_embeddings)
    print(f"tiny model written to {out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Infrastructure, gateway, scheduler, control and the scaler; the model is applied as a
    deployment, whose engines the scaler starts (and adds, up to --max-engines, under load)."""
    from services.control.client import write_cli_config
    from shared.localstack import LocalStack
    from shared.logging import configure_logging
    from shared.protocol import served_model_name
    from shared.tiny_model import ensure_tiny_model

    settings = Settings.from_args(args)
    configure_logging("up", settings.log_format, settings.log_level)
    model_dir = settings.model or str(ensure_tiny_model(settings.tiny_model_dir))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    name = served_model_name(model_dir)
    # Our own NATS admits only the services' roles (credentials by environment); our own Valkey
    # keeps its data (AOF) under STRATA_HOME/data, so desired state outlives a crash or a restart.
    stack = LocalStack(model_dir, engines=0, port=args.port, nats_url=settings.nats_url,
                       redis_url=settings.redis_url, api_key=settings.api_key, log_dir=settings.home / "logs",
                       deployment=name, control=True, scaler=True, control_port=args.control_port, auth=True,
                       data_dir=None if settings.nats_url and settings.redis_url else settings.home / "data")
    with stack:
        stack.deploy({"name": name, "model": model_dir,
                      "replicas": {"min": args.engines, "max": max(args.max_engines, args.engines)}})
        if args.engines:
            stack.wait_replicas(name, args.engines)
            stack.wait_serving()  # "up" means a request is served, not only that ports are open
        write_cli_config(stack.control_url, stack.api_key, settings.home)
        credentials = write_nats_credentials(stack.infra, settings.home)
        print(f"strata is up\n"
              f"  base url: {stack.base_url}/v1\n"
              f"  api key:  {stack.api_key}\n"
              f"  model:    {name} ({model_dir})\n"
              f"  engines:  {args.engines} (scaler: up to {max(args.max_engines, args.engines)})\n"
              f"  control:  {stack.control_url}  (dashboard: {stack.control_url}/dashboard#key={stack.api_key})\n"
              f"  nats:     {stack.infra.nats_url}"
              f"{f' (credentials: {credentials})' if credentials else ''}\n"
              f"  redis:    {stack.infra.redis_url}\n"
              f"  logs:     {stack.log_dir}\n"
              f"  status:   strata status {name}\n"
              f"Ctrl-C stops everything.", flush=True)
        while not stop.wait(2.0):
            try:  # a store that lost its data gets the admin key back (shared.store.StoreEpoch)
                stack.ensure_key()
            except Exception as exc:
                print(f"warning: cannot provision the admin key: {exc}", file=sys.stderr, flush=True)
        print("stopping", flush=True)
    return 0


def write_nats_credentials(infra, home) -> str:
    """STRATA_NATS_USER / STRATA_NATS_PASSWORD for the admin (`strata logs`) and a bus client
    (another team's service, docs/protocol.md), one env file each, readable only by this user;
    returns their directory ("" without auth)."""
    if not infra.users:
        return ""
    directory = home / "nats"
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    for role in ("admin", "client"):
        path = directory / f"{role}.env"
        path.touch(0o600)
        path.chmod(0o600)
        path.write_text("".join(f"{k}={v}\n" for k, v in infra.env_for(role).items()))
    return str(directory)


def cmd_keys_create(args: argparse.Namespace) -> int:
    """Over control's API; with --redis-url straight into Redis (the first admin key)."""
    settings = Settings.from_args(args)
    if not settings.redis_url:
        return _api(args, lambda c: c.create_key(args.name, args.rpm, args.tpm, args.priority, args.admin),
                    lambda r: r["api_key"])
    import asyncio

    from services.gateway.auth import create_key
    from shared.store import connect_redis

    async def create() -> str:
        redis = connect_redis(settings.redis_url)
        try:
            return await create_key(redis, args.name, rpm=args.rpm, tpm=args.tpm, priority=args.priority,
                                    admin=args.admin)
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
                     service=args.service, request_id=args.request, since=args.since, auth=settings.nats_auth())

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


# ---- deployments (over control's REST API) ---------------------------------------------------
def _api(args: argparse.Namespace, call, render) -> int:
    """Run one API call; print JSON with --json, else the rendered text; errors to stderr."""
    import json

    from services.control.client import ControlClient, ControlError

    client = ControlClient(args.control_url, args.api_key)
    try:
        result = call(client)
    except ControlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if getattr(args, "json", False) else render(result))
    return 0


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _serving(serving: dict) -> str:
    return ", ".join(f"r{rev} {pct}%" for rev, pct in serving.items()) or "nothing"


def render_status(d: dict) -> str:
    dep = d["deployment"]
    lines = [f"deployment {dep['name']}  (generation {dep['generation']}, latest revision {dep['latest']})",
             f"  traffic:    {_serving(d['serving'])}",
             f"  routing:    {dep['routing_policy']}",
             f"  queue:      {d['queue']['depth']} waiting (oldest {d['queue']['oldest_wait_s']:.1f} s)",
             f"  throughput: {d['throughput']['requests_per_s']} req/s, {d['throughput']['tokens_per_s']} tok/s",
             f"  latency:    TTFT p90 {_ms(d['latency']['ttft_p90_s'])}, ITL p50 {_ms(d['latency']['itl_p50_s'])}"]
    for s in d.get("scaler", []):
        lines.append(f"  scaler:     r{s['revision']} desired {s['desired']} (ready {s['ready']}, "
                     f"starting {s['starting']}){' PANIC' if s['panic'] else ''}: {s['reason']}")
    lines.append("")
    lines.append(_table([[r["replica_id"], f"r{r['revision']}", r["state"], r["running"], r["waiting"],
                          f"{r['kv_usage']:.0%}", r["tokens_per_s"], _ms(r["ttft_p90_s"]), r["finished"], r["failed"]]
                         for r in d["replicas"]],
                        ["REPLICA", "REV", "STATE", "RUNNING", "WAITING", "KV", "TOK/S", "TTFT P90", "DONE", "FAILED"])
                 if d["replicas"] else "  no replicas")
    return "\n".join(lines)


def render_list(d: dict) -> str:
    if not d["deployments"]:
        return "no deployments"
    return _table([[x["name"], _serving(x["serving"]), x["latest"], x["replicas_ready"], x["routing_policy"]]
                   for x in d["deployments"]], ["NAME", "TRAFFIC", "LATEST", "READY", "ROUTING"])


def render_change(d: dict) -> str:
    dep = d["deployment"]
    rev = f"revision {d['revision']} applied; " if "revision" in d else ""
    return f"{dep['name']}: {rev}traffic {_serving(d.get('serving') or {str(dep['stable']): 100})}"


def render_history(d: dict) -> str:
    import datetime

    rows = []
    for e in d["events"]:
        at = datetime.datetime.fromtimestamp(e["at"]).strftime("%Y-%m-%d %H:%M:%S")
        traffic = f"r{e['stable']}" + (f" + r{e['canary']} {e['canary_weight']}%" if e["canary"] else "")
        rows.append([e["generation"], at, e["action"], e.get("revision", ""), traffic, e.get("actor", "")])
    revs = _table([[rev, spec["model"], f"{spec['replicas']['min']}-{spec['replicas']['max']}",
                    spec["canary"]["weight"]] for rev, spec in d["revisions"].items()],
                  ["REVISION", "MODEL", "REPLICAS", "CANARY%"])
    return revs + "\n\n" + _table(rows, ["GEN", "AT", "ACTION", "REVISION", "TRAFFIC", "BY"])


def cmd_deploy(args: argparse.Namespace) -> int:
    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file).read()
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 1
    return _api(args, lambda c: c.deploy(text), render_change)


def cmd_status(args: argparse.Namespace) -> int:
    if args.name:
        return _api(args, lambda c: c.status(args.name), render_status)
    return _api(args, lambda c: c.deployments(), render_list)


def cmd_canary(args: argparse.Namespace) -> int:
    return _api(args, lambda c: c.canary(args.name, args.weight, args.revision), render_change)


def cmd_promote(args: argparse.Namespace) -> int:
    return _api(args, lambda c: c.promote(args.name), render_change)


def cmd_rollback(args: argparse.Namespace) -> int:
    return _api(args, lambda c: c.rollback(args.name, args.to), render_change)


def cmd_history(args: argparse.Namespace) -> int:
    return _api(args, lambda c: c.history(args.name), render_history)


def cmd_delete(args: argparse.Namespace) -> int:
    return _api(args, lambda c: c.delete(args.name), lambda r: f"deleted {r['deleted']}")


def _control_args(p: argparse.ArgumentParser, json_output: bool = True) -> None:
    p.add_argument("--control-url", default="", help="(env STRATA_CONTROL_URL; default: from `strata up`)")
    p.add_argument("--api-key", default="", help="an admin key (env STRATA_API_KEY; default: from `strata up`)")
    if json_output:
        p.add_argument("--json", action="store_true", help="machine-readable output")


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
    p.add_argument("--engines", type=int, default=1, help="engines to start with (the deployment's minimum)")
    p.add_argument("--max-engines", type=int, default=2, help="most engines the scaler may run")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--control-port", type=int, default=8081)
    Settings.add_arguments(p)
    p.set_defaults(func=cmd_up)

    keys_parser = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys_parser.add_subparsers(dest="keys_command", required=True)
    p = keys_sub.add_parser("create", help="create an API key and print it (only its hash is stored)")
    p.add_argument("--name", required=True, help="tenant name")
    p.add_argument("--rpm", type=int, default=0, help="requests per minute (0: unlimited)")
    p.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: unlimited)")
    p.add_argument("--priority", default="standard", choices=PRIORITIES)
    p.add_argument("--admin", action="store_true", help="may use control's API")
    p.add_argument("--redis-url", dest="settings_redis_url", default=None,
                   help="write the key straight into Redis instead of through control (the first admin key)")
    _control_args(p)
    p.set_defaults(func=cmd_keys_create)
    _add_observability_commands(sub)

    sub.add_parser("simulate", add_help=False,
                   help="simulate a fleet under the scaler's policy: strata simulate TRACE [options]; "
                        "`strata simulate --help` lists them")

    p = sub.add_parser("deploy", help="apply a deployment spec (YAML or JSON; - for stdin): a new revision")
    p.add_argument("file")
    _control_args(p)
    p.set_defaults(func=cmd_deploy)
    p = sub.add_parser("status", help="deployments, or one deployment's revisions, replicas, queue, latency")
    p.add_argument("name", nargs="?")
    _control_args(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("canary", help="send a share of traffic to the canary revision")
    p.add_argument("name")
    p.add_argument("--weight", type=int, required=True, help="percent of traffic, 0-100")
    p.add_argument("--revision", type=int, default=None, help="make this revision the canary")
    _control_args(p)
    p.set_defaults(func=cmd_canary)
    p = sub.add_parser("promote", help="the canary revision takes all traffic")
    p.add_argument("name")
    _control_args(p)
    p.set_defaults(func=cmd_promote)
    p = sub.add_parser("rollback", help="drop the canary, or go back to the previous (or a named) revision")
    p.add_argument("name")
    p.add_argument("--to", type=int, default=None, help="revision to serve")
    _control_args(p)
    p.set_defaults(func=cmd_rollback)
    p = sub.add_parser("history", help="a deployment's revisions and changes")
    p.add_argument("name")
    _control_args(p)
    p.set_defaults(func=cmd_history)
    p = sub.add_parser("delete", help="delete a deployment (its replicas drain and stop)")
    p.add_argument("name")
    _control_args(p)
    p.set_defaults(func=cmd_delete)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # the simulator owns its flags (services.scaler.simulator)
        from services.scaler import simulator

        return simulator.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
