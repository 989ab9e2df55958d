"""The `strata` command line."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

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
    from shared.localstack import LocalStack, PortInUse, check_ports_free
    from shared.logging import configure_logging
    from shared.protocol import served_model_name
    from shared.tiny_model import ensure_tiny_model

    try:  # before anything starts (the tiny model's first build takes a while)
        check_ports_free({p: what for p, what in ((args.port, "gateway"), (args.control_port, "control")) if p})
    except PortInUse as exc:
        print(f"error: {exc} (--port, --control-port)", file=sys.stderr)
        return 1
    settings = Settings.from_args(args)
    configure_logging("up", settings.log_format, settings.log_level)
    model_dir = settings.model or str(ensure_tiny_model(settings.tiny_model_dir))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    name = served_model_name(model_dir)
    stack = LocalStack(model_dir, engines=0, port=args.port, nats_url=settings.nats_url,
                       redis_url=settings.redis_url, api_key=settings.api_key, log_dir=settings.home / "logs",
                       deployment=name, control=True, scaler=True, control_port=args.control_port)
    try:
        stack.start()
    except PortInUse as exc:
        print(f"error: {exc} (--port, --control-port)", file=sys.stderr)
        return 1
    try:
        stack.deploy({"name": name, "model": model_dir,
                      "replicas": {"min": args.engines, "max": max(args.max_engines, args.engines)}})
        if args.engines:
            stack.wait_replicas(name, args.engines)
        dashboard = f"{stack.control_url}/dashboard#key={stack.api_key}"
        saved = write_cli_config(stack.control_url, stack.api_key, settings.home, base_url=f"{stack.base_url}/v1",
                                 dashboard_url=dashboard, nats_url=stack.infra.nats_url,
                                 redis_url=stack.infra.redis_url, log_dir=str(stack.log_dir))
        print(f"strata is up\n"
              f"  base url: {stack.base_url}/v1\n"
              f"  api key:  {stack.api_key}\n"
              f"  model:    {name} ({model_dir})\n"
              f"  engines:  {args.engines} (scaler: up to {max(args.max_engines, args.engines)})\n"
              f"  control:  {stack.control_url}  (dashboard: {dashboard})\n"
              f"  nats:     {stack.infra.nats_url}\n"
              f"  redis:    {stack.infra.redis_url}\n"
              f"  logs:     {stack.log_dir}\n"
              f"  saved:    {saved} (strata status, logs, diagnose, keys ... read it)\n"
              f"  status:   strata status {name}\n"
              f"Ctrl-C stops everything.", flush=True)
        stop.wait()
        print("stopping", flush=True)
    finally:
        stack.stop()
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    import datetime

    def render(r: dict) -> str:
        return _table([[k["id"], k["name"], "admin" if k["admin"] else "", k["priority"], k["rpm"] or "-",
                        k["tpm"] or "-", datetime.datetime.fromtimestamp(k["created"]).strftime("%Y-%m-%d %H:%M:%S")]
                       for k in r["keys"]], ["ID", "NAME", "ADMIN", "PRIORITY", "RPM", "TPM", "CREATED"]) \
            if r["keys"] else "no API keys"

    return _api(args, lambda c: c.keys(), render)


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    return _api(args, lambda c: c.revoke_key(args.id),
                lambda r: f"revoked key {r['revoked']}: every gateway refuses it from now on")


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


def _saved(settings: Settings, name: str) -> tuple[str, str]:
    """A URL setting (flag or environment), else the one `strata up` saved: (url, where from)."""
    from services.control.client import cli_config_path, read_cli_config

    value = getattr(settings, name)
    if value:
        return value, ""
    saved = read_cli_config(settings.home).get(name, "")
    return saved, f" (from {cli_config_path(settings.home)})" if saved else ""


def cmd_logs(args: argparse.Namespace) -> int:
    import asyncio

    from services.control.logs import RETENTION_S, follow, render, request_id

    settings = Settings.from_args(args)
    nats_url, where = _saved(settings, "nats_url")
    if not nats_url:
        print("--nats-url (or STRATA_NATS_URL) is required: no `strata up` saved one", file=sys.stderr)
        return 2
    rid = request_id(args.request) if args.request else None
    # One request's lines are in the past: look back as far as JetStream keeps them, unless told.
    since = args.since if args.since or not (rid or args.no_follow) else RETENTION_S
    print(f"logs from {nats_url}{where}" + (f", request {rid}" if rid else "")
          + (f", from {since:.0f} s back" if since else "") + ("" if args.no_follow else ", following (Ctrl-C stops)"),
          file=sys.stderr)
    found = [0]

    def emit(line) -> None:
        found[0] += 1
        print(render(line, args.json), flush=True)

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await follow(nats_url, emit, stop, service=args.service, request_id=rid, since=since,
                     live=not args.no_follow)

    try:
        asyncio.run(run())
    except Exception as exc:  # no server, no JetStream: say so rather than print nothing
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.no_follow and not found[0]:
        what = f"request {rid}" if rid else "these filters"
        print(f"no log lines for {what} in the last {since:.0f} s", file=sys.stderr)
        return 1
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from services.control.diagnose import Thresholds, diagnose, render
    from services.control.figures import gather

    settings = Settings.from_args(args)
    redis_url, where = _saved(settings, "redis_url")
    if not redis_url:
        print("--redis-url (or STRATA_REDIS_URL) is required: services are found through the registry "
              "(no `strata up` saved one)", file=sys.stderr)
        return 2
    if where and not args.json:
        print(f"registry: {redis_url}{where}", file=sys.stderr)
    figures = asyncio.run(gather(redis_url, args.since, args.gateway_url))
    if args.deployment:
        figures.deployments = [d for d in figures.deployments if d.name == args.deployment]
    report = diagnose(figures, Thresholds(itl_slo_s=args.itl_slo))
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 0


def _add_observability_commands(sub) -> None:
    p = sub.add_parser("logs", help="follow the services' log lines live (over NATS)")
    p.add_argument("--service", choices=["gateway", "scheduler", "engine", "scaler", "control"])
    p.add_argument("--request", metavar="ID", help="only the lines of this request: the response's id "
                                                   "(chatcmpl-..., cmpl-...) or its x-request-id header")
    p.add_argument("--since", type=_duration, default=0.0, metavar="DURATION",
                   help="start this far back, e.g. 5m (replayed from JetStream), then follow "
                        "(default: live only; with --request or --no-follow, the hour JetStream keeps)")
    p.add_argument("--no-follow", action="store_true", help="print what was logged and exit (1 if nothing)")
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

    client = ControlClient(args.control_url, args.api_key, home=Path(args.settings_home) if args.settings_home else None)
    print(f"control: {client.url} ({client.source})", file=sys.stderr)
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
    if d.get("analysis") and d["analysis"]["status"] == "running":
        a = d["analysis"]
        lines.append(f"  canary:     r{a['canary']} analysis at {a['step']}% "
                     f"({(a['last'] or {}).get('reason', 'starting')}; strata canary status {dep['name']})")
    lines.append("")
    lines.append(_table([[r["replica_id"], f"r{r['revision']}", r["state"], r["running"], r["waiting"],
                          f"{r['kv_usage']:.0%}", r["tokens_per_s"], _ms(r["ttft_p90_s"]), r["finished"], r["failed"],
                          r.get("metrics_url")] for r in d["replicas"]],
                        ["REPLICA", "REV", "STATE", "RUNNING", "WAITING", "KV", "TOK/S", "TTFT P90", "DONE", "FAILED",
                         "METRICS"])
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
    line = f"{dep['name']}: {rev}traffic {_serving(d['serving'])}"
    if d.get("analysis"):
        steps = " -> ".join(f"{w}%" for w in d["analysis"]["steps"] if w < 100)
        line += (f"\n  canary analysis: r{dep['canary']} at {steps}, then promoted to 100% (or rolled back when "
                 f"worse than r{dep['stable']}); `strata canary status {dep['name']}` follows it")
    return line


def _verdict_lines(v: dict) -> list[str]:
    lines = [f"    {v['decision'].upper()} at {v['step']}%: {v['reason']}"]
    lines += [f"      {'x' if c['failed'] else '-'} {c['detail']}" for c in v.get("checks", [])]
    return lines


def render_canary_status(d: dict) -> str:
    import datetime

    a = d["analysis"]
    at = datetime.datetime.fromtimestamp(a["started_at"]).strftime("%Y-%m-%d %H:%M:%S")
    lines = [f"canary analysis of {a['deployment']}: r{a['canary']} against stable r{a['stable']} (started {at})",
             f"  status:  {a['status']}" + (f" ({a['reason']})" if a["reason"] else ""),
             f"  steps:   " + " -> ".join(f"[{w}%]" if i == a["step_index"] and a["status"] == "running" else f"{w}%"
                                        for i, w in enumerate(a["steps"])) + " -> promote",
             f"  traffic: {_serving(d['serving'])}"]
    if a["last"] and a["status"] == "running":
        lines.append("  now:")
        lines += _verdict_lines(a["last"])
    if a["verdicts"]:
        lines.append("  decided:")
        for v in a["verdicts"]:
            lines += _verdict_lines(v)
    return "\n".join(lines)


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
    """`strata canary NAME --weight W [--revision R]`, or `strata canary status NAME`."""
    if args.name == "status" and args.target:
        return _api(args, lambda c: c.canary_status(args.target), render_canary_status)
    if args.target:
        print(f"error: unexpected argument {args.target!r} (strata canary NAME --weight W, or strata canary "
              f"status NAME)", file=sys.stderr)
        return 2
    if args.weight is None:
        print("error: --weight is required to change the canary's share (strata canary status NAME shows its "
              "analysis)", file=sys.stderr)
        return 2
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
    p.add_argument("--home", dest="settings_home", default=None,
                   help="where `strata up` saved its addresses (env STRATA_HOME; default ~/.strata)")
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
    p.add_argument("--priority", default="standard", choices=["critical", "standard", "sheddable"])
    p.add_argument("--admin", action="store_true", help="may use control's API")
    p.add_argument("--redis-url", dest="settings_redis_url", default=None,
                   help="write the key straight into Redis instead of through control (the first admin key)")
    _control_args(p)
    p.set_defaults(func=cmd_keys_create)
    p = keys_sub.add_parser("list", help="every key's id, name, limits and creation time (never the key itself)")
    _control_args(p)
    p.set_defaults(func=cmd_keys_list)
    p = keys_sub.add_parser("revoke", help="revoke a key: every gateway refuses it within a second")
    p.add_argument("id", help="the key's id (from strata keys list; 8 or more of its characters) or the key itself")
    _control_args(p)
    p.set_defaults(func=cmd_keys_revoke)
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
    p = sub.add_parser("canary", help="send a share of traffic to the canary revision; `strata canary status NAME`: "
                                      "its automatic analysis")
    p.add_argument("name", help="the deployment (or `status`, then the deployment)")
    p.add_argument("target", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--weight", type=int, default=None, help="percent of traffic, 0-100")
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
