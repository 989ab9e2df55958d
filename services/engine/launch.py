"""How an engine process is started on this machine: its command line (the worker's flags and
a deployment spec's engine arguments, made from EngineArgs) and its share of the CPU cores.
The scaler's local actuator and shared.localstack both start engines through this module.

CPU threads: torch (and OpenMP in the CPU kernels) take one thread per core by default, so two
engines on one machine would each run as many threads as there are cores and take turns
spinning on them. An engine started here gets `cores // engines` threads (at least one) for the
engines that may run at once, unless its flags give --threads or the environment
OMP_NUM_THREADS: what is given explicitly wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.engine.config import EngineArgs

THREADS_ENV = "OMP_NUM_THREADS"


def engine_flags(model: str, replica_id: str, deployment: str, nats_url: str, redis_url: str, *,
                 revision: int | None = None, pool: str = "", region: str = "",
                 engine: Mapping[str, Any] | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The flags of one engine worker (`python -m services.engine FLAGS`); `engine`: a
    deployment spec's engine arguments (spec keys), `extra`: more flags as given (an
    operator's, a test's)."""
    args = ["--model", str(model), "--replica-id", replica_id, "--deployment", deployment]
    if revision is not None:
        args += ["--revision", str(revision)]
    args += ["--nats-url", nats_url, "--redis-url", redis_url, "--log-format", "json"]
    args += [*(["--pool", pool] if pool else []), *(["--region", region] if region else [])]
    return [*args, *EngineArgs.cli_flags(dict(engine or {})), *extra]


def check_engine_flags(flags: Sequence[str]) -> None:
    """Raise ValueError naming any flag the engine would refuse (unknown, or a bad value), so
    that it is refused where it is given, not by every engine started with it."""
    from services.engine.__main__ import build_parser

    try:
        _, unknown = build_parser(exit_on_error=False).parse_known_args(list(flags))
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    if unknown:
        raise ValueError(f"unknown engine flag{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}")


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, as a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_share(engines: int, cores: int | None = None) -> int:
    """Threads for each of `engines` engines sharing `cores` cores (at least one)."""
    return max(1, (cores or cpu_cores()) // max(engines, 1))


def threads_chosen(flags: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether an engine's flags or environment already say how many threads it runs."""
    flag = _threads_arg().flag
    return THREADS_ENV in environ or any(f == flag or f.startswith(flag + "=") for f in flags)


def _threads_arg():
    return next(a for a in EngineArgs.schema() if a.name == "num_threads")


@dataclass
class CoreShares:
    """The engines that may run at once on this machine, summed over whoever starts them (each
    local pool of the scaler says how many it may run), and so each engine's thread share."""

    cores: int = field(default_factory=cpu_cores)
    planned: dict[str, int] = field(default_factory=dict)  # owner -> engines it may run at once

    def plan(self, owner: str, engines: int) -> None:
        self.planned[owner] = max(engines, 0)

    def threads(self) -> int:
        return thread_share(sum(self.planned.values()), self.cores)

    def launch(self, args: list[str], environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        """An engine's flags and environment with its thread share, unless they already choose
        its threads."""
        env = dict(environ)
        if threads_chosen(args, env):
            return args, env
        n = self.threads()
        env[THREADS_ENV] = str(n)
        return [*args, *_threads_arg().flags(n)], env
