"""NATS connection helper: reconnecting client, typed publish/subscribe, W3C trace headers.

Every publish and request injects the current OpenTelemetry context as `traceparent`/`tracestate`
headers; every handler runs with the context extracted from the message's headers, so spans
started there join the caller's trace. A malformed payload never reaches a handler: it gets an
`ErrorReply` (when it has a reply subject) and a log line, and the subscription keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import propagate

from shared import protocol
from shared.logging import get_logger
from shared.protocol import ErrorCode, ErrorInfo, ErrorReply, InvalidRequest, Message, ProtocolError, TokenChunk

log = get_logger()
M = TypeVar("M", bound=Message)
Handler = Callable[[M, Msg], Awaitable[None]]


def trace_headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    headers: dict[str, str] = dict(extra or {})
    propagate.inject(headers)
    return headers


def context_of(msg: Msg) -> otel_context.Context:
    return propagate.extract(msg.headers or {})


def servers(url: str) -> list[str]:
    """A NATS URL, or a comma-separated list of them (the nodes of a cluster): the client picks
    one and fails over to the others (and to those the cluster announces)."""
    return [u.strip() for u in url.split(",") if u.strip()]


@dataclass(frozen=True)
class NatsAuth:
    """How a service proves who it is to NATS (shared.nats_auth defines the roles and what each
    may publish and subscribe to). A user and password, or a NATS credentials file (JWT and nkey
    seed, for operator-managed accounts); TLS with a CA (and a client certificate, if the server
    asks for one). Empty: no authentication (a server that requires none)."""

    user: str = ""
    password: str = field(default="", repr=False)
    creds: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def inbox_prefix(self) -> str:
        """Replies to this connection come under `_INBOX.<user>`: each role may subscribe to its
        own inboxes only, so no one else can read its replies or streams."""
        return f"_INBOX.{self.user}" if self.user else "_INBOX"

    def connect_options(self) -> dict:
        options: dict = {"inbox_prefix": self.inbox_prefix}
        if self.user:
            options.update(user=self.user, password=self.password)
        if self.creds:
            options["user_credentials"] = self.creds
        if self.tls_ca or self.tls_cert:
            import ssl

            context = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key or None)
            options["tls"] = context
        return options

    @classmethod
    def from_settings(cls, settings) -> "NatsAuth":
        return cls(settings.nats_user, settings.nats_password, settings.nats_creds, settings.nats_tls_ca,
                   settings.nats_tls_cert, settings.nats_tls_key)


class Bus:
    """A thin typed layer over one nats-py connection."""

    def __init__(self, nc: NatsClient, auth: NatsAuth | None = None):
        self.nc = nc
        self.inbox_prefix = (auth or NatsAuth()).inbox_prefix
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def connect(cls, url: str, name: str, connect_timeout: float = 5.0, auth: NatsAuth | None = None) -> "Bus":
        async def on_error(exc: Exception) -> None:
            log.warning("nats error", error=str(exc))

        async def on_disconnect() -> None:
            log.warning("nats disconnected")

        async def on_reconnect() -> None:
            log.info("nats reconnected", server=str(nc.connected_url.netloc if nc.connected_url else ""))

        auth = auth or NatsAuth()
        nc = await nats.connect(
            servers=servers(url), name=name, connect_timeout=connect_timeout,
            allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
            ping_interval=5, max_outstanding_pings=3,
            error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
            **auth.connect_options(),
        )
        return cls(nc, auth)

    async def publish(self, subject: str, msg: Message | bytes, reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        payload = msg if isinstance(msg, bytes) else protocol.encode(msg)
        await self.nc.publish(subject, payload, reply=reply, headers=trace_headers(headers))

    async def request(self, subject: str, msg: Message | bytes, timeout: float,
                      headers: dict[str, str] | None = None) -> Msg:
        payload = msg if isinstance(msg, bytes) else protocol.encode(msg)
        return await self.nc.request(subject, payload, timeout=timeout, headers=trace_headers(headers))

    async def reply_error(self, msg: Msg, code: str, message: str, request_id: str | None = None) -> None:
        if msg.reply:
            await self.publish(msg.reply, ErrorReply(error=ErrorInfo(code=code, message=message),
                                                     request_id=request_id))

    async def subscribe(self, subject: str, message_type: type[M], handler: Handler,
                        queue: str = "", concurrent: bool = False):
        """Decode each message as `message_type` and call `handler(message, raw_msg)`.

        concurrent=True runs each handler in its own task (for handlers that wait, e.g. on a
        request's stream); otherwise messages are handled in order.
        """

        async def run(raw: Msg) -> None:
            token = otel_context.attach(context_of(raw))
            try:
                try:
                    message = protocol.decode(message_type, raw.data)
                except ProtocolError as exc:
                    log.warning("malformed message", subject=raw.subject, error=str(exc))
                    if raw.reply:
                        await self.reply_error(raw, ErrorCode.BAD_REQUEST, str(exc))
                    elif isinstance(exc, InvalidRequest):  # well-formed: its stream subject is the caller's
                        await self.publish(exc.reply_to, TokenChunk(
                            request_id=exc.request_id, seq=0, finish_reason="error",
                            error=ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(exc))))
                    return
                await handler(message, raw)
            except Exception as exc:  # a handler bug must not kill the subscription
                log.exception("handler failed", subject=raw.subject)
                try:
                    await self.reply_error(raw, ErrorCode.INTERNAL, f"internal error: {exc.__class__.__name__}")
                except Exception:
                    pass
            finally:
                otel_context.detach(token)

        async def callback(raw: Msg) -> None:
            if concurrent:
                task = asyncio.create_task(run(raw))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                await run(raw)

        return await self.nc.subscribe(subject, queue=queue, cb=callback)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=5)
            except Exception:
                await self.nc.close()
