"""shared.http_limits on a real aiohttp server: a write to a client that stopped reading ends at
the write timeout instead of blocking its handler for as long as the client likes."""

import asyncio
import socket
import time

from aiohttp import web

from shared.http_limits import ConnectionGuard, HttpLimits, serve


async def test_a_write_to_a_client_that_does_not_read_times_out():
    guard = ConnectionGuard(HttpLimits(write_timeout=1.0))
    outcome = asyncio.get_running_loop().create_future()

    async def flood(request: web.Request) -> web.StreamResponse:
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        response = web.StreamResponse()
        await response.prepare(request)
        started = time.monotonic()
        try:
            for _ in range(10_000):
                async with guard.write_deadline():
                    await response.write(b"x" * 65536)
            outcome.set_result(("wrote everything", time.monotonic() - started))
        except TimeoutError:
            outcome.set_result(("timed out", time.monotonic() - started))
        return response

    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get("/flood", flood)
    runner = web.AppRunner(app, **guard.limits.runner_kwargs())
    await runner.setup()
    server = await serve(runner, guard, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    client.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
    try:
        what, took = await asyncio.wait_for(outcome, 30)
    finally:
        client.close()
        server.close()
        await runner.cleanup()
    assert what == "timed out" and took < 5.0, (what, took)
