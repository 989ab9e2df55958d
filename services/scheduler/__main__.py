"""python -m services.scheduler [--scheduler-id ID] --nats-url URL --redis-url URL"""

from __future__ import annotations

import argparse
import sys

from services.scheduler.regions import DEFAULT_PENALTY_S
from services.scheduler.service import SchedulerConfig, SchedulerService
from shared.service_main import UsageError, service_main, service_parser
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("scheduler", "Strata scheduler", "scheduler-id")
    p.add_argument("--ack-timeout", type=float, default=2.0)
    p.add_argument("--policy", default="kv_aware", choices=["round_robin", "least_load", "kv_aware"],
                   help="default routing policy")
    p.add_argument("--policy-for", action="append", default=[], metavar="MODEL=POLICY",
                   help="routing policy of one deployment (repeatable)")
    p.add_argument("--load-weight", type=float, default=4.0,
                   help="kv_aware: blocks of prefill that one request of load on a replica is worth")
    p.add_argument("--max-queue", type=int, default=1024, help="requests the admission queue holds per model")
    p.add_argument("--max-queue-wait", type=float, default=30.0,
                   help="seconds a request may wait in the admission queue before it is refused (overloaded)")
    p.add_argument("--no-replica-wait", type=float, default=10.0,
                   help="seconds a request for a model with no deployment and no replica (not even starting) "
                        "waits for one")
    p.add_argument("--inter-region-penalty-ms", type=float, default=DEFAULT_PENALTY_S * 1e3,
                   help="route out of the request's region only when the queueing avoided exceeds this")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0, help="/metrics and /health (0: any free port)")
    Settings.add_arguments(p)
    return p


def make_scheduler(args: argparse.Namespace, settings: Settings) -> SchedulerService:
    if args.inter_region_penalty_ms < 0:
        raise UsageError("--inter-region-penalty-ms must not be negative")
    policies = dict(item.split("=", 1) for item in args.policy_for)
    return SchedulerService(SchedulerConfig(
        settings.nats_url, settings.redis_url, args.scheduler_id, policy=args.policy, policies=policies,
        load_weight=args.load_weight, ack_timeout=args.ack_timeout, max_queue=args.max_queue,
        max_queue_wait=args.max_queue_wait, no_replica_wait=args.no_replica_wait,
        http_host=args.http_host, http_port=args.http_port, region=settings.region,
        inter_region_penalty_s=args.inter_region_penalty_ms / 1e3, nats_auth=settings.nats_auth()))


def main(argv=None) -> int:
    return service_main("scheduler", build_parser(), "scheduler-id", make_scheduler, argv)


if __name__ == "__main__":
    sys.exit(main())
