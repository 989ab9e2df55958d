"""python -m services.scaler --nats-url URL --redis-url URL [--actuator local|kubernetes]"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from services.scaler.actuators import KubernetesActuator, LocalProcessActuator, pool_actuator
from services.scaler.service import ScalerConfig, ScalerService
from shared import aio, telemetry
from shared.logging import configure_logging
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.scaler", description="Strata autoscaler")
    p.add_argument("--scaler-id", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--actuator", choices=["local", "kubernetes"], default="local",
                   help="local: engine processes on this machine; kubernetes: scale Deployments (the one place "
                        "while control stores no capacity pools; each stored pool has its own actuator)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between decisions")
    p.add_argument("--pool-backoff", type=float, default=30.0,
                   help="seconds a capacity pool that refused gets no more replicas (doubles while it keeps refusing)")
    p.add_argument("--pool-max-backoff", type=float, default=600.0, help="the longest back-off, seconds")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0, help="/metrics and /health (0: any free port)")
    local = p.add_argument_group("local actuator")
    local.add_argument("--engine-log-dir", default="", help="engine logs (default: STRATA_HOME/logs)")
    local.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for every engine started (repeatable, e.g. --engine-arg=--threads=1)")
    k8s = p.add_argument_group("kubernetes actuator")
    k8s.add_argument("--k8s-api-url", default="", help="default: the in-cluster API server")
    k8s.add_argument("--k8s-namespace", default="", help="default: the pod's namespace")
    k8s.add_argument("--k8s-deployment-prefix", default="strata-engine-")
    k8s.add_argument("--k8s-token", default="", help="default: the pod's service-account token")
    Settings.add_arguments(p)
    return p


def engine_nats_env(environ=os.environ) -> dict[str, str]:
    """The engines the local actuator starts get the engine role's NATS credentials, given to the
    scaler as STRATA_ENGINE_NATS_USER / STRATA_ENGINE_NATS_PASSWORD (not its own role's)."""
    return {f"STRATA_NATS_{name}": environ[f"STRATA_ENGINE_NATS_{name}"] for name in ("USER", "PASSWORD")
            if f"STRATA_ENGINE_NATS_{name}" in environ}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.from_args(args)
    configure_logging("scaler", settings.log_format, settings.log_level)
    if not settings.nats_url or not settings.redis_url:
        print("--nats-url and --redis-url are required", file=sys.stderr)
        return 2
    log_dir = Path(args.engine_log_dir or settings.home / "logs")
    if args.actuator == "kubernetes":
        try:
            actuator = KubernetesActuator(args.k8s_api_url, args.k8s_namespace, args.k8s_deployment_prefix,
                                          args.k8s_token)
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    else:
        actuator = LocalProcessActuator(settings.nats_url, settings.redis_url, log_dir=log_dir,
                                        extra_args=args.engine_arg, region=settings.region,
                                        engine_env=engine_nats_env())
    # Pools stored in control each get their own actuator (local engines take --engine-arg too).
    def make_actuator(spec):
        return pool_actuator(spec, settings.nats_url, settings.redis_url, log_dir, args.engine_arg,
                             engine_env=engine_nats_env())

    try:
        service = ScalerService(ScalerConfig(settings.nats_url, settings.redis_url, args.scaler_id, args.interval,
                                             http_host=args.http_host, http_port=args.http_port, region=settings.region,
                                             pool_backoff_s=args.pool_backoff, pool_max_backoff_s=args.pool_max_backoff,
                                             nats_auth=settings.nats_auth()),
                                actuator, make_actuator)
    except ValueError as exc:  # --pool-backoff / --pool-max-backoff
        print(f"--pool-backoff, --pool-max-backoff: {exc}", file=sys.stderr)
        return 2
    aio.run(telemetry.observed("scaler", args.scaler_id, settings.nats_url, aio.serve_until_signalled(service),
                               settings.nats_auth()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
