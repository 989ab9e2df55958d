"""Routing policies: pure functions of the replicas' state, no I/O (the simulator reuses them)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class ReplicaState:
    replica_id: str
    state: str = "ready"
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 1
    inflight: int = 0  # requests this scheduler sent since the replica's last heartbeat
    last_seen: float = 0.0

    @property
    def load(self) -> float:
        """Requests on the replica, counting ones routed since its last report."""
        return self.running + self.waiting + self.inflight

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(self.kv_blocks_total, 1)


def least_load(candidates: list[ReplicaState], rng: random.Random) -> list[ReplicaState]:
    """Candidates ordered best first: fewest requests, then least KV in use; ties at random."""
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=lambda r: (r.load, r.kv_usage))
