"""Bounds on what one HTTP connection may hold: slow or idle clients cannot pin a server.

aiohttp has a keep-alive timeout but no timeout on reading a request's head, nor a limit on open
connections, and it reads bodies as slowly as they come. `ConnectionGuard` wraps the protocol
aiohttp makes for each connection (from the runner's public `server` factory) and adds:

- a header timeout: a request's line and headers must be complete `header_timeout` seconds after
  its first byte (on a new connection, after it was accepted); else 408 and the connection closes;
- a connection limit: past `max_connections` open connections, a new one is answered 503 with
  Retry-After and closed at once;
- the idle keep-alive timeout, aiohttp's own (`keepalive_timeout`, given to the runner).

Reading a body (`read_body`) and writing a response (`write_deadline`) have their own timeouts.
The guard learns that a request's head is complete from its middleware, which aiohttp runs once
the head is parsed, before the body is read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web


@dataclass
class HttpLimits:
    header_timeout: float = 10.0  # request line and headers, from the first byte (or the accept)
    body_timeout: float = 30.0  # the whole body, from when the head was complete
    write_timeout: float = 30.0  # one write to a client that does not read (a stalled stream)
    keepalive_timeout: float = 15.0  # an idle keep-alive connection between requests
    max_connections: int = 4096  # open connections; more are refused with 503
    # After answering a request whose body was not read (refused early, or too slow), aiohttp
    # reads and drops the rest of it this long before closing (its default, 10 s, is what a
    # client sending a byte a second would want).
    lingering_time: float = 1.0

    def runner_kwargs(self) -> dict:
        return {"keepalive_timeout": self.keepalive_timeout, "lingering_time": self.lingering_time}


class ClientGone(Exception):
    """The client went away (status 499: nobody reads the answer) or is too slow sending its
    request (408)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _raw_response(status: int, reason: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "overloaded_error" if status == 503 else
                                 "invalid_request_error", "param": None, "code": None}}).encode()
    headers = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
               "Connection: close"]
    if retry_after is not None:
        headers.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


class _GuardedProtocol(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's protocol, timing the request heads."""

    def __init__(self, guard: "ConnectionGuard", inner: asyncio.Protocol | None):
        self.guard, self.inner = guard, inner  # inner None: refused (over the connection limit)
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = False  # a request's head is complete and it is being handled

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.inner is None:
            self.guard.count("connection_limit")
            transport.write(_raw_response(503, "Service Unavailable", "too many open connections, try again",
                                          retry_after=1))
            transport.close()
            return
        self.guard.connections[transport] = self
        self._arm()
        self.inner.connection_made(transport)

    def _arm(self) -> None:
        self.timer = asyncio.get_running_loop().call_later(self.guard.limits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self.timer = None
        if not self.busy and self.transport is not None and not self.transport.is_closing():
            self.guard.count("header_timeout")
            self.transport.write(_raw_response(408, "Request Timeout", "the request head was not complete in time"))
            self.transport.close()

    def request_started(self) -> None:
        self.busy = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def request_done(self) -> None:
        self.busy = False  # the next request's head is timed from its first byte

    def data_received(self, data: bytes) -> None:
        if not self.busy and self.timer is None:
            self._arm()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.inner is None:
            return
        self.guard.connections.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class ConnectionGuard:
    """Install `middleware` in the app (outermost), then serve `protocol_factory(runner.server)`
    with `loop.create_server`. `on_refusal(reason)` counts what the guard refused."""

    def __init__(self, limits: HttpLimits, on_refusal: Callable[[str], None] | None = None):
        self.limits = limits
        self.on_refusal = on_refusal
        self.connections: dict[asyncio.BaseTransport, _GuardedProtocol] = {}

    @property
    def open(self) -> int:
        return len(self.connections)

    def count(self, reason: str) -> None:
        if self.on_refusal is not None:
            self.on_refusal(reason)

    def protocol_factory(self, server: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            if len(self.connections) >= self.limits.max_connections:
                return _GuardedProtocol(self, None)
            return _GuardedProtocol(self, server())
        return make

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        conn = self.connections.get(request.transport)
        if conn is not None:
            conn.request_started()
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.request_done()

    async def read_body(self, request: web.Request) -> bytes:
        """The request's body within body_timeout; ClientGone if the client left or is too slow."""
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                return await request.read()
        except TimeoutError:
            self.count("body_timeout")
            raise ClientGone(f"the request body did not arrive within {self.limits.body_timeout:g}s", 408) from None
        except ConnectionError as exc:  # the client disconnected mid-body
            raise ClientGone(f"the client disconnected while sending the body: {exc}", 499) from None

    def write_deadline(self):
        """`async with guard.write_deadline(): await response.write(...)`: TimeoutError if a
        client stops reading for write_timeout (its socket buffer full)."""
        return asyncio.timeout(self.limits.write_timeout)


async def serve(runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int) -> asyncio.AbstractServer:
    """Listen on host:port with the guard around the runner's connections (runner set up)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(guard.protocol_factory(runner.server), host, port, reuse_address=True,
                                    backlog=1024)
