"""python -m services.scaler --nats-url URL --redis-url URL [--actuator local|kubernetes]"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from services.engine.launch import CoreShares, check_engine_flags
from services.scaler.actuators import KubernetesActuator, LocalProcessActuator, pool_actuator
from services.scaler.service import ScalerConfig, ScalerService
from shared.service_main import UsageError, service_main, service_parser
from shared.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("scaler", "Strata autoscaler", "scaler-id")
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


def make_scaler(args: argparse.Namespace, settings: Settings) -> ScalerService:
    log_dir = Path(args.engine_log_dir or settings.home / "logs")
    try:  # refused here, naming it, rather than by every engine started with it
        check_engine_flags(args.engine_arg)
    except ValueError as exc:
        raise UsageError(f"--engine-arg: {exc}") from None
    cores = CoreShares()  # every local pool's engines run on this machine's cores
    if args.actuator == "kubernetes":
        try:
            actuator = KubernetesActuator(args.k8s_api_url, args.k8s_namespace, args.k8s_deployment_prefix,
                                          args.k8s_token)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        actuator = LocalProcessActuator(settings.nats_url, settings.redis_url, log_dir=log_dir,
                                        extra_args=args.engine_arg, region=settings.region,
                                        engine_env=engine_nats_env(), cores=cores)

    # Pools stored in control each get their own actuator (local engines take --engine-arg too).
    def make_actuator(spec):
        return pool_actuator(spec, settings.nats_url, settings.redis_url, log_dir, args.engine_arg,
                             engine_env=engine_nats_env(), cores=cores)

    try:
        return ScalerService(ScalerConfig(settings.nats_url, settings.redis_url, args.scaler_id, args.interval,
                                          http_host=args.http_host, http_port=args.http_port, region=settings.region,
                                          pool_backoff_s=args.pool_backoff, pool_max_backoff_s=args.pool_max_backoff,
                                          nats_auth=settings.nats_auth()),
                             actuator, make_actuator)
    except ValueError as exc:
        raise UsageError(f"--pool-backoff, --pool-max-backoff: {exc}") from None


def main(argv=None) -> int:
    return service_main("scaler", build_parser(), "scaler-id", make_scaler, argv)


if __name__ == "__main__":
    sys.exit(main())
