"""The admission queue: where requests wait while every replica is saturated.

Ordered by priority class (critical, then standard, then sheddable); within a class, tenants
take turns (round robin over per-tenant FIFO queues), so one tenant's burst does not starve the
others. Bounded: when full, a new request displaces the newest request of a lower class, or is
refused. A request that cannot start before its deadline (the time by which it must start: the
request's own deadline less the time it takes to serve, or the queue's wait budget) is refused
early, and with the drain rate known, at once. Pure logic, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from shared.protocol import PRIORITIES


def priority_rank(priority: str | None) -> int:
    return PRIORITIES.index(priority) if priority in PRIORITIES else 1


@dataclass
class QueuedRequest:
    request_id: str
    tenant: str
    priority: str
    enqueued_at: float
    deadline: float | None  # unix seconds by which it must start (None: whenever)
    payload: Any = None  # the GenerateRequest


@dataclass
class _Class:
    tenants: OrderedDict[str, deque[QueuedRequest]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return sum(len(q) for q in self.tenants.values())


class AdmissionQueue:
    def __init__(self, max_size: int = 1024):
        self.max_size = max_size
        self.classes = [_Class() for _ in PRIORITIES]
        self.index: dict[str, QueuedRequest] = {}
        self.drain_rate = 0.0  # requests dispatched per second (EWMA), for early rejection

    def __len__(self) -> int:
        return len(self.index)

    def push(self, item: QueuedRequest) -> QueuedRequest | None:
        """Queue item. Returns a request that must be refused now (the item itself, or one it
        displaced), or None."""
        rank = priority_rank(item.priority)
        displaced = None
        if len(self.index) >= self.max_size:
            displaced = self._newest_below(rank)
            if displaced is None:
                return item
            self.remove(displaced.request_id)
        cls = self.classes[rank]
        cls.tenants.setdefault(item.tenant, deque()).append(item)
        self.index[item.request_id] = item
        return displaced

    def pop(self) -> QueuedRequest | None:
        """The next request: highest class first, tenants of a class in turn."""
        for cls in self.classes:
            while cls.tenants:
                tenant, queue = next(iter(cls.tenants.items()))
                cls.tenants.move_to_end(tenant)  # this tenant's turn is used
                if queue:
                    item = queue.popleft()
                    if not queue:
                        del cls.tenants[tenant]
                    del self.index[item.request_id]
                    return item
                del cls.tenants[tenant]
        return None

    def remove(self, request_id: str) -> QueuedRequest | None:
        item = self.index.pop(request_id, None)
        if item is None:
            return None
        cls = self.classes[priority_rank(item.priority)]
        queue = cls.tenants.get(item.tenant)
        if queue is not None:
            queue.remove(item)
            if not queue:
                del cls.tenants[item.tenant]
        return item

    def position(self, request_id: str) -> int:
        """How many requests pop() serves before this one."""
        item = self.index[request_id]
        rank = priority_rank(item.priority)
        ahead = sum(len(c) for c in self.classes[:rank])
        tenants = list(self.classes[rank].tenants.items())
        k = next(i for i, (t, _) in enumerate(tenants) if t == item.tenant)
        j = tenants[k][1].index(item)
        # Tenants before ours in the rotation get j + 1 turns before it, those after get j.
        ahead += sum(min(len(q), j + 1 if i < k else j) for i, (_, q) in enumerate(tenants) if i != k)
        return ahead + j

    def expired(self, now: float) -> list[QueuedRequest]:
        """Requests that can no longer start before their deadline (at the current drain rate),
        removed from the queue. One pass: a request's position is estimated from its class,
        its place in its tenant's queue and the number of tenants taking turns."""
        doomed = []
        ahead = 0
        for cls in self.classes:
            turns = len(cls.tenants)
            for t_order, queue in enumerate(cls.tenants.values()):
                for j, item in enumerate(queue):
                    if item.deadline is None:
                        continue
                    position = ahead + j * turns + t_order
                    wait = position / self.drain_rate if self.drain_rate > 0 else 0.0
                    if now + wait >= item.deadline:
                        doomed.append(item)
            ahead += len(cls)
        return [self.remove(item.request_id) for item in doomed]

    def estimated_wait(self, priority: str | None) -> float | None:
        """Seconds a request of this class queued now would wait before it starts (None while
        the drain rate is unknown): everything of its class and above goes first."""
        if self.drain_rate <= 0:
            return None
        rank = priority_rank(priority)
        return sum(len(c) for c in self.classes[:rank + 1]) / self.drain_rate

    def retry_after(self, lo: float = 1.0, hi: float = 30.0) -> float:
        """When a refused request may find room: the time the queue takes to drain."""
        wait = len(self) / self.drain_rate if self.drain_rate > 0 else lo
        return min(max(wait, lo), hi)

    def oldest_wait(self, now: float) -> float:
        return max((now - i.enqueued_at for i in self.index.values()), default=0.0)

    def note_dispatch_rate(self, dispatched: int, seconds: float, alpha: float = 0.3) -> None:
        """Update the drain rate from a period in which requests were dispatched (a period with
        none says nothing about the rate once room appears; it would only decay the estimate)."""
        if seconds > 0 and dispatched > 0:
            rate = dispatched / seconds
            self.drain_rate = rate if self.drain_rate == 0 else (1 - alpha) * self.drain_rate + alpha * rate

    def _newest_below(self, rank: int) -> QueuedRequest | None:
        for cls in reversed(self.classes[rank + 1:]):
            newest = None
            for queue in cls.tenants.values():
                if queue and (newest is None or queue[-1].enqueued_at > newest.enqueued_at):
                    newest = queue[-1]
            if newest is not None:
                return newest
        return None
