"""One `Flow` per engine request the gateway serves (one per prompt of an HTTP request): all of
its state, from the moment it is opened to the moment it is closed, in one object.

A flow has one or more legs: a leg is one engine's run of it, with its own request id on the bus
(the flow's id, then `<id>-m1`, `<id>-m2`, ... after migrations: services.gateway.migration).
Chunks come on the flow's reply subject (`<inbox>.<flow id>`) or in a TokenChunkBatch naming the
leg, so the table finds a flow by either id. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shared.protocol import GenerateRequest, TokenChunk


@dataclass
class Flow:
    gen: GenerateRequest  # the request as the client made it (its first leg)
    queue: asyncio.Queue  # its chunks, read by the HTTP handler in order
    # Ends the wait if even the engine's final chunk at the deadline never comes (a lost
    # message, a dead engine): a final error chunk is put in the queue then.
    timer: asyncio.TimerHandle | None = None
    first: TokenChunk | None = None  # its first chunk, once it came
    done: bool = False  # its stream ended: nothing runs on, so closing it cancels nothing
    closed: bool = False  # the request ended (the client left): a leg submitted now must be cancelled
    # The current leg.
    leg_id: str = ""  # its request id on the bus ("": between two legs, nothing is delivered)
    held_by: str | None = None  # the scheduler holding it, until an engine takes it
    at_engine: bool = False  # an engine took it (its notice may come before the scheduler's answer)
    replica: str | None = None  # the replica running it, once known
    expected_seq: int = 0  # its next chunk's seq
    last_progress: float = field(default_factory=time.monotonic)  # a chunk or an acceptance of it
    # The whole stream, across legs.
    legs: list[str] = field(default_factory=list)  # every leg's request id, the current one last
    token_ids: list[int] = field(default_factory=list)  # completion tokens delivered so far
    text_chars: int = 0  # completion text delivered so far
    migrations: int = 0
    migrating: bool = False

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    @property
    def tenant(self) -> str | None:
        return self.gen.tenant

    @property
    def ids(self) -> list[int]:
        """The prompt's token ids."""
        return self.gen.prompt_token_ids

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class FlowTable:
    """The open flows, by flow id and by the id of each of their legs."""

    def __init__(self):
        self._flows: dict[str, Flow] = {}
        self._legs: dict[str, Flow] = {}

    def open(self, flow: Flow) -> None:
        """Register a new flow; its first leg is the request itself."""
        if flow.request_id in self._flows:
            raise ValueError(f"flow {flow.request_id} is already open")
        self._flows[flow.request_id] = flow
        self.start_leg(flow, flow.request_id)

    def start_leg(self, flow: Flow, leg_id: str) -> None:
        """The flow's next leg: only its chunks count from now on, and no scheduler or engine
        holds it yet."""
        flow.leg_id, flow.replica, flow.expected_seq = leg_id, None, 0
        flow.held_by, flow.at_engine = None, False
        flow.last_progress = time.monotonic()
        flow.legs.append(leg_id)
        if not flow.closed:
            self._legs[leg_id] = flow

    def close(self, flow: Flow) -> str:
        """The request ended: forget the flow. Returns the id of its current leg (the one to
        cancel if it runs on), or "" while it is between legs (the lost leg was cancelled, and
        the next is cancelled on arrival because the flow is closed). Closing twice is a no-op
        returning ""."""
        if flow.closed:
            return ""
        flow.closed = True
        if flow.timer is not None:
            flow.timer.cancel()
        self._flows.pop(flow.request_id, None)
        for leg in flow.legs:
            self._legs.pop(leg, None)
        return flow.leg_id

    def get(self, request_id: str) -> Flow | None:
        return self._flows.get(request_id)

    def of_leg(self, leg_id: str) -> Flow | None:
        """The open flow one of whose legs has this request id (a chunk's request_id)."""
        return self._legs.get(leg_id)

    def __iter__(self):
        return iter(list(self._flows.values()))

    def __len__(self) -> int:
        return len(self._flows)
