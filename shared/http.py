"""The small HTTP side of a service: /metrics and /health on aiohttp, on the given host and port."""

from __future__ import annotations

from aiohttp import web


async def serve(routes: dict[str, object], host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serve GET routes (path -> handler); returns the runner (to clean up) and the base URL
    (port 0 picks a free port, and the URL names the one chosen)."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
