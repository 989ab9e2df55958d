"""The small HTTP side of a service: /metrics and /health on aiohttp, on the given host and port."""

from __future__ import annotations

import socket

from aiohttp import web

ANY_ADDRESS = ("0.0.0.0", "::", "")


def advertised_url(host: str, port: int) -> str:
    """The base URL others reach a server on: bound to every address, it is this machine's (or
    container's) host name, which its neighbours resolve; else the address it is bound to."""
    return f"http://{socket.gethostname() if host in ANY_ADDRESS else host}:{port}"


async def serve(routes: dict[str, object], host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serve GET routes (path -> handler); returns the runner (to clean up) and the advertised
    base URL (port 0 picks a free port, and the URL names the one chosen)."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, advertised_url(host, site._server.sockets[0].getsockname()[1])
