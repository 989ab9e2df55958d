"""LoRA adapter placement: which adapters each replica keeps resident, from recent demand.
Pure (no I/O): the scheduler runs it every second, the fleet simulator reuses it.

Packing: each replica has `max_loras` device slots; an adapter that carries a share s of the
demand on n replicas gets ceil(headroom * s * n) replicas (at least one), so no replica takes
more than its share of one adapter's load, with room for bursts (headroom 1.5: a burst that
spills goes to another holder, not to a replica that must load it). Copies go out hottest adapter first; each goes to a replica
that already has the adapter resident if one has a free slot (no load at all), else to the
replica with the least demand placed so far (balance). What does not fit in the slots (the
cold tail) is not placed: its requests go where it is resident or cached, else where the
load is lowest. The router scores placement beside residency (services.scheduler.policy),
and the engines' LRU slots make the placed adapters resident on the replicas that get them.

The scaler's adapter term (`adapter_replica_floor`): the adapters in use need at least
ceil(count / max_loras) replicas to be resident at once.
"""

from __future__ import annotations

import math


class DemandWindow:
    """Requests per adapter, exponentially decayed (half-life `half_life_s`)."""

    def __init__(self, half_life_s: float = 30.0):
        self.rate = math.log(2) / half_life_s
        self.counts: dict[str, float] = {}
        self.at = 0.0

    def _decay(self, now: float) -> None:
        if now > self.at:
            factor = math.exp(-self.rate * (now - self.at))
            self.counts = {a: c * factor for a, c in self.counts.items() if c * factor > 1e-3}
            self.at = now

    def add(self, adapter: str, now: float, n: float = 1.0) -> None:
        self._decay(now)
        self.counts[adapter] = self.counts.get(adapter, 0.0) + n

    def demand(self, now: float) -> dict[str, float]:
        self._decay(now)
        return dict(self.counts)


def place_adapters(demand: dict[str, float], slots: dict[str, int],
                   resident: dict[str, set[str]] | None = None, headroom: float = 1.5) -> dict[str, set[str]]:
    """replica -> adapters it should keep resident. `demand`: adapter -> recent requests;
    `slots`: replica -> max_loras; `resident`: replica -> adapters resident there now."""
    resident = resident or {}
    placement: dict[str, set[str]] = {r: set() for r in slots}
    total = sum(demand.values())
    if total <= 0 or not slots:
        return placement
    free = dict(slots)
    load = dict.fromkeys(slots, 0.0)
    n = len(slots)
    for adapter in sorted(demand, key=lambda a: (-demand[a], a)):
        share = demand[adapter] / total
        copies = min(n, max(1, math.ceil(headroom * share * n - 1e-9)))
        for _ in range(copies):
            open_ = [r for r in slots if free[r] > 0 and adapter not in placement[r]]
            if not open_:
                break
            # Where it is resident already (no load), else the least loaded; ids break ties.
            choice = min(open_, key=lambda r: (adapter not in resident.get(r, ()), load[r], r))
            placement[choice].add(adapter)
            free[choice] -= 1
            load[choice] += demand[adapter] / copies
        if not any(free.values()):
            break
    return placement


def placed_replicas(placement: dict[str, set[str]]) -> dict[str, set[str]]:
    """adapter -> replicas it is placed on (the inverse of place_adapters' result)."""
    out: dict[str, set[str]] = {}
    for replica, adapters in placement.items():
        for adapter in adapters:
            out.setdefault(adapter, set()).add(replica)
    return out


def adapter_replica_floor(adapters_in_use: set[str], max_loras: int) -> int:
    """Replicas needed for every adapter in use to be resident somewhere at once."""
    if not adapters_in_use or max_loras <= 0:
        return 0
    return math.ceil(len(adapters_in_use) / max_loras)
