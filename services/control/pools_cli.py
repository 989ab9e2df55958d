"""`strata pools`: capacity pools over control's API (services.control.pools_api).

    strata pools                              capacity, used, cost and refusals of every pool
    strata pools apply pools.yaml             store pools (one, a list, or {pools: [...]})
    strata pools set spot-east --capacity 40  change a pool at run time (capacity, cost, cold start)
    strata pools delete spot-east             its replicas move to the other pools, then it is gone
"""

from __future__ import annotations

import argparse
import sys

from shared.pools import UNLIMITED


def _money(x: float) -> str:
    return f"${x:,.2f}"


def _state(status: dict) -> str:
    if status["backoff_s"] > 0:
        return f"backed off {status['backoff_s']:.0f} s: {status['last_refusal']}"
    if not status["effective_capacity"]:
        return "no capacity"
    if status["effective_capacity"] <= status["used"]:
        return "full"
    return "ok"


def render_pools(d: dict) -> str:
    from services.control.cli import _table

    if not d["pools"]:
        return "no capacity pools (the scaler places every replica with its own actuator)"
    rows = []
    for p in d["pools"]:
        spec, status = p["spec"] or {}, p["status"]
        kind = (spec.get("actuator") or {}).get("kind") or (status or {}).get("kind") or "scaler's own"
        capacity = (status or spec).get("capacity", 0)
        cap = "no limit" if capacity >= UNLIMITED else str(capacity)
        if status is None:
            rows.append([p["name"], spec.get("region") or "-", kind, cap, "-", "-", "-", _money(spec["cost_per_hour"]),
                         "-", f"{spec['cold_start_s']:g} s (spec)", "-", "no report from the scaler"])
            continue
        if status["effective_capacity"] != capacity:
            cap = f"{status['effective_capacity']}/{cap}"
        cold = f"{status['cold_start_s']:.0f} s" + ("" if status["cold_start_measured"] else " (spec)")
        rows.append([p["name"], status["region"] or "-", kind, cap, status["used"],
                     f"{status['ready']}/{status['starting']}/{status['draining']}",
                     ", ".join(f"{dep} {n}" for dep, n in sorted(status["deployments"].items())) or "-",
                     _money(status["cost_per_hour"]), _money(status["used"] * status["cost_per_hour"]), cold,
                     status["refusals"], _state(status)])
    lines = [_table(rows, ["POOL", "REGION", "KIND", "CAPACITY", "USED", "READY/START/DRAIN", "DEPLOYMENTS",
                           "COST/REPLICA-H", "SPEND/H", "COLD START", "REFUSALS", "STATE"])]
    for dep, short in sorted(d["short"].items()):
        lines.append(f"short: {dep} wants {d['wanted'].get(dep, '?')} replicas, {short} cannot be placed: every pool "
                     f"it may use is full or refusing")
    if d["scaler"] is None:
        lines.append("(no scaler has reported in the last seconds: figures are the stored specs only)")
    return "\n".join(lines)


def render_change(d: dict) -> str:
    if "deleted" in d:
        return f"deleted pool {d['deleted']} (its replicas move to the other pools first)"
    if "pool" in d:
        p = d["pool"]
        return f"pool {p['name']}: {', '.join(f'{k} {p[k]}' for k in d['changed'])} (generation {p['generation']})"
    return "\n".join(f"pool {p['name']}: applied (generation {p['generation']}, capacity {p['capacity']}, "
                     f"{_money(p['cost_per_hour'])}/replica-hour)" for p in d["pools"])


def cmd_pools(args: argparse.Namespace) -> int:
    from services.control.cli import _api

    return _api(args, lambda c: c.pools(), render_pools)


def cmd_pools_apply(args: argparse.Namespace) -> int:
    from services.control.cli import _api

    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file).read()
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 1
    return _api(args, lambda c: c.apply_pools(text), render_change)


def cmd_pools_set(args: argparse.Namespace) -> int:
    from services.control.cli import _api

    changes = {k: v for k, v in (("capacity", args.capacity), ("cost_per_hour", args.cost),
                                 ("cold_start_s", args.cold_start), ("region", args.region)) if v is not None}
    if args.label:
        labels = {}
        for item in args.label:
            key, sep, value = item.partition("=")
            if not sep or not key:
                print(f"error: --label {item!r}: expected KEY=VALUE", file=sys.stderr)
                return 2
            labels[key] = value
        changes["labels"] = labels
    if not changes:
        print("error: nothing to change: give --capacity, --cost, --cold-start, --region or --label", file=sys.stderr)
        return 2
    return _api(args, lambda c: c.set_pool(args.name, changes), render_change)


def cmd_pools_delete(args: argparse.Namespace) -> int:
    from services.control.cli import _api

    return _api(args, lambda c: c.delete_pool(args.name), render_change)


def add_pool_commands(sub, control_args) -> None:
    p = sub.add_parser("pools", help="capacity pools: capacity, used, cost and refusals of each (apply, set, delete)")
    control_args(p)
    p.set_defaults(func=cmd_pools)
    ps = p.add_subparsers(dest="pools_command")
    q = ps.add_parser("apply", help="store capacity pools from a YAML or JSON file (- for stdin)")
    q.add_argument("file")
    control_args(q)
    q.set_defaults(func=cmd_pools_apply)
    q = ps.add_parser("set", help="change a pool at run time")
    q.add_argument("name")
    q.add_argument("--capacity", type=int, help="replicas the pool may hold")
    q.add_argument("--cost", type=float, help="cost per replica-hour")
    q.add_argument("--cold-start", type=float, help="cold-start estimate, seconds (until the scaler measures one)")
    q.add_argument("--region")
    q.add_argument("--label", action="append", metavar="KEY=VALUE", help="replaces the labels (repeatable)")
    control_args(q)
    q.set_defaults(func=cmd_pools_set)
    q = ps.add_parser("delete", help="delete a pool (its replicas move to the others, then it is gone)")
    q.add_argument("name")
    control_args(q)
    q.set_defaults(func=cmd_pools_delete)
