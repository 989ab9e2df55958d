"""Running a service's main coroutine: on uvloop when it is installed (lower per-hop latency)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


def run(main: Coroutine) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
