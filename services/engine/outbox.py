"""The worker's outbox: everything its streams send, published in order by one task, each
step's chunks grouped by destination.

A request whose GenerateRequest names `batch_to` (a gateway's subject) gets its chunks in one
TokenChunkBatch per step together with every other request bound there; one without it gets one
TokenChunk per chunk on its reply_to, as callers that are not gateways expect. Anything else
(acks) goes out as it is. A step is what one turn of the event loop emits: the engine delivers
a step's outputs to the sinks in one callback, so the step closes on the next turn
(`loop.call_soon`). When the loop has fallen behind and finds two steps' deliveries queued back
to back, they close together: a batch then holds a request's chunks of both, in seq order —
fewer messages when they matter most.

`group_step` is the grouping alone (no I/O); `Outbox` queues, encodes (once per message: a
batch is one encode) and publishes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from collections.abc import Awaitable, Callable

from shared import protocol
from shared.logging import get_logger
from shared.protocol import Message, TokenChunk, TokenChunkBatch

log = get_logger()


@dataclass(slots=True)
class Outgoing:
    """One message a stream sends: `batched` chunks go into their subject's TokenChunkBatch."""

    subject: str
    message: Message
    batched: bool = False


def group_step(step: list[Outgoing], replica_id: str) -> list[tuple[str, Message]]:
    """One step's messages in publish order: the batched chunks of each subject gathered into one
    TokenChunkBatch, in the order they came; the others as they are. A batch goes out where its
    subject's last chunk came, so every message sent before a chunk is still published before it
    (a withdrawn request's ack before its final chunk)."""
    chunks: dict[str, list[TokenChunk]] = {}
    last: dict[str, int] = {}
    for i, out in enumerate(step):
        if out.batched:
            chunks.setdefault(out.subject, []).append(out.message)
            last[out.subject] = i
    ordered: list[tuple[str, Message]] = []
    for i, out in enumerate(step):
        if not out.batched:
            ordered.append((out.subject, out.message))
        elif last[out.subject] == i:
            ordered.append((out.subject, TokenChunkBatch(replica_id=replica_id, chunks=chunks[out.subject])))
    return ordered


class Outbox:
    """`publish(subject, payload)` sends one encoded message (the worker's bus)."""

    def __init__(self, publish: Callable[[str, bytes], Awaitable[None]], replica_id: str):
        self.publish, self.replica_id = publish, replica_id
        self._step: list[Outgoing] = []
        self._queue: deque[tuple[str, bytes]] = deque()  # encoded, in publish order
        self._ready = asyncio.Event()

    def send(self, subject: str, message: Message) -> None:
        self._add(Outgoing(subject, message))

    def send_chunk(self, req: protocol.GenerateRequest, chunk: TokenChunk) -> None:
        """A chunk of `req`'s stream: into this step's batch for its gateway, or alone on reply_to."""
        if req.batch_to is not None:
            self._add(Outgoing(req.batch_to, chunk, batched=True))
        else:
            self._add(Outgoing(req.reply_to, chunk))

    def _add(self, out: Outgoing) -> None:
        if not self._step:
            asyncio.get_running_loop().call_soon(self._close_step)
        self._step.append(out)

    def _close_step(self) -> None:
        step, self._step = self._step, []
        self._queue.extend((subject, protocol.encode(message)) for subject, message in group_step(step, self.replica_id))
        self._ready.set()

    async def run(self) -> None:
        """The publisher: one wake per step."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self.flush()

    async def flush(self) -> None:
        """Publish everything sent so far, the open step included."""
        if self._step:
            self._close_step()
        while self._queue:  # one at a time: whatever a cancellation interrupts stays queued
            subject, payload = self._queue[0]
            try:
                await self.publish(subject, payload)
            except Exception as exc:  # NATS away: the caller's deadline ends the wait
                log.warning("chunk publish failed", subject=subject, error=str(exc))
            self._queue.popleft()
