"""Running a service's main coroutine: on uvloop when it is installed (lower per-hop latency)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


def run(main: Coroutine):
    """Run main to completion and return its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve_until_signalled(service) -> None:
    """Start a service (start()/stop() coroutines), run until SIGTERM or SIGINT, stop it."""
    import signal

    await service.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
