"""Routing policies: pure functions of the replicas' state, no I/O (the simulator reuses them).

kv_aware scores each replica by what the request would cost there, in blocks of prefill work:
the prompt blocks it still has to compute (those beyond its longest cached prefix) plus its
load, each request it carries (running, queued, or routed since its last report) counting as
`load_weight` blocks. A popular prefix therefore stays on its holder only while the holder is
not much busier than recomputing the prefix elsewhere: hot prefixes spread instead of piling up.
A request for a LoRA adapter adds the adapter's cost there (`adapter_cost`): nothing where it is
resident in a device slot, a little where it is in the host cache, more where it must be read
from disk, and more again on a replica the placement policy (services.scheduler.lora_placement)
did not pack it onto.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_load", "kv_aware")

# A LoRA adapter's cost on a replica, in blocks of prefill work (see Router.adapter_cost).
ADAPTER_CACHED_COST = 6.0  # in the host cache: a host-to-device copy, and maybe a wait for a free slot
ADAPTER_LOAD_COST = 16.0  # neither: read from disk, then copied
ADAPTER_UNPLACED_COST = 24.0  # placement packed it elsewhere (a load there evicts what was packed)


@dataclass
class ReplicaState:
    replica_id: str
    state: str = "ready"
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 1
    max_num_seqs: int = 64
    block_size: int = 16
    inflight: int = 0  # requests this scheduler sent that the replica has not acknowledged yet
    # Accept numbers of requests it acknowledged that its last report did not count yet.
    unreported: list[int] = field(default_factory=list)
    accepted_reported: int = 0  # the accepted_total of its last report
    last_seen: float = 0.0
    revision: int = 0  # deployment revision it serves (0: unmanaged)
    region: str = ""  # where it runs ("": near every request)
    finish_rate: float = 0.0  # requests it finishes per second (moving average of its reports)
    ttft_s: float | None = None  # recent time to first token there (p90)
    lora_resident: frozenset[str] = frozenset()  # LoRA adapters in its device slots
    lora_cached: frozenset[str] = frozenset()  # LoRA adapters in its host cache
    max_loras: int = 0  # device slots for adapters (0: it serves none)
    max_model_len: int = 0  # its effective context length and vocabulary (0: not said)
    vocab_size: int = 0

    @property
    def load(self) -> int:
        """Requests on the replica: its last report, plus what this scheduler sent since."""
        return self.running + self.waiting + self.inflight + len(self.unreported)

    def reported(self, accepted_total: int) -> None:
        """A report counts every request the replica accepted up to accepted_total."""
        self.accepted_reported = accepted_total
        self.unreported = [s for s in self.unreported if s > accepted_total]

    def acknowledged(self, accepted_seq: int) -> None:
        """The replica took a request from us; count it until a report includes it."""
        if accepted_seq > self.accepted_reported:
            self.unreported.append(accepted_seq)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(self.kv_blocks_total, 1)

    @property
    def saturated(self) -> bool:
        """Full batch and a queue: more work would only wait there."""
        return self.load >= self.max_num_seqs + 1 or self.kv_usage >= 0.98


@dataclass
class Decision:
    replica: ReplicaState
    policy: str
    cached_blocks: int = 0  # of the prompt's full blocks, how many the chosen replica holds
    prompt_blocks: int = 0
    scores: dict[str, float] = field(default_factory=dict)  # cost per candidate (kv_aware)


def prefix_overlaps(holders: list[set[str]], replica_ids: list[str]) -> dict[str, int]:
    """Longest run of leading blocks each replica holds (holders[i]: replicas holding block i)."""
    overlap = dict.fromkeys(replica_ids, 0)
    alive = set(replica_ids)
    for i, holding in enumerate(holders):
        alive &= holding
        if not alive:
            break
        for r in alive:
            overlap[r] = i + 1
    return overlap


def _load_key(r: ReplicaState) -> tuple[int, float]:
    """least_load's order: fewest requests in flight, then the emptiest KV cache."""
    return (r.load, r.kv_usage)


class Router:
    """Chooses replicas; holds only the round-robin cursor and a seeded RNG for ties."""

    def __init__(self, load_weight: float = 4.0, seed: int | None = None):
        self.load_weight = load_weight
        self.rng = random.Random(seed)
        self._rr = itertools.count()

    def rank(self, policy: str, candidates: list[ReplicaState], prompt_blocks: int = 0,
             overlaps: dict[str, int] | None = None, adapter: str | None = None,
             placed: set[str] | None = None) -> list[Decision]:
        """Candidates best first under `policy`. `adapter`: the request's LoRA adapter; `placed`:
        the replicas placement packed it onto (kv_aware weighs both)."""
        if not candidates:
            return []
        shuffled = list(candidates)
        self.rng.shuffle(shuffled)  # ties broken at random
        overlaps = overlaps or {}
        if policy == "round_robin":
            start = next(self._rr) % len(candidates)
            ordered = sorted(candidates, key=lambda r: r.replica_id)
            ordered = ordered[start:] + ordered[:start]
            return [Decision(r, policy, overlaps.get(r.replica_id, 0), prompt_blocks) for r in ordered]
        if policy == "least_load":
            ordered = sorted(shuffled, key=_load_key)
            return [Decision(r, policy, overlaps.get(r.replica_id, 0), prompt_blocks) for r in ordered]
        if policy == "kv_aware":
            costs = {r.replica_id: self.cost(r, prompt_blocks, overlaps.get(r.replica_id, 0))
                     + self.adapter_cost(r, adapter, placed) for r in shuffled}
            ordered = sorted(shuffled, key=lambda r: costs[r.replica_id])
            return [Decision(r, policy, overlaps.get(r.replica_id, 0), prompt_blocks, costs) for r in ordered]
        raise ValueError(f"unknown routing policy {policy!r} (one of {', '.join(POLICIES)})")

    def least_loaded(self, candidates: list[ReplicaState]) -> ReplicaState:
        """rank("least_load", candidates)[0].replica, the same draw from the RNG, without
        ordering the rest (the simulators route millions of requests through it)."""
        shuffled = list(candidates)
        self.rng.shuffle(shuffled)
        return min(shuffled, key=_load_key)

    def cost(self, r: ReplicaState, prompt_blocks: int, cached_blocks: int) -> float:
        prefill = prompt_blocks + 1 - cached_blocks  # the partial last block is always computed
        return prefill + self.load_weight * r.load

    @staticmethod
    def adapter_cost(r: ReplicaState, adapter: str | None, placed: set[str] | None = None) -> float:
        """resident < cached < must load, plus a penalty off the adapter's placement."""
        if adapter is None:
            return 0.0
        cost = 0.0 if adapter in r.lora_resident else ADAPTER_CACHED_COST if adapter in r.lora_cached \
            else ADAPTER_LOAD_COST
        if placed and r.replica_id not in placed:
            cost += ADAPTER_UNPLACED_COST
        return cost
