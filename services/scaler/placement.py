"""Placement: a deployment's replica count split across capacity pools.

Pure policy, no I/O and no clock: the scaler service feeds it the pools (shared.pools) and what
each one holds, the simulator feeds it simulated ones, and both act on the same plans.

- Order: the deployment's allowed pools (those it names, with the labels it asks for), by its
  preference: `cheapest` (cost per replica-hour, then cold start), `nearest` (pools in its region
  first, then by cost) or `pinned` (a share of the replicas per pool; what a pool cannot take
  goes to the others by cost).
- Ideal: fill pools in that order up to each one's room (its capacity, less what other
  deployments hold and what drains there), then spread: until `min_pools` pools hold one, the
  fullest gives one to the next pool in the order. Wanted replicas no pool can take are `short`.
- Refusal: a pool that refuses or cannot place (quota exhausted, Kubernetes pods pending past a
  timeout, the local pool at its limit) is held, for a back-off that doubles with every refusal
  in a row, at what it held when it refused. Placing again at once sends the rest to the next
  pool in the same tick. When the back-off ends the pool has its whole capacity again (a probe);
  once it holds more than it did when it refused, it is healthy and the count starts over.
- Make-before-break: replicas beyond a pool's ideal count (capacity came back to a cheaper pool,
  a share or the allowed pools changed) stay until their replacements are ready. As many are
  kept as the ideal slots not yet ready, so the ready replicas never fall below the wanted count
  while replicas move; the least preferred pools give theirs up first. Replicas still starting
  beyond the ideal are cancelled at once: they serve nobody yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from shared.deployments import Placement


class PoolLike(Protocol):
    """What placement reads of a pool (shared.pools.PoolSpec, or the simulator's pools)."""

    name: str
    region: str
    capacity: int
    cost_per_hour: float
    cold_start_s: float
    labels: dict[str, str]


@dataclass(frozen=True)
class PoolView:
    """A pool as placement sees it now (PoolLike), where the figures differ from the spec: the
    measured cold start, no capacity for a pool being retired, what the oracle knows ahead."""

    name: str
    region: str
    capacity: int
    cost_per_hour: float
    cold_start_s: float
    labels: dict


@dataclass
class Held:
    """What one pool holds of one deployment (revision) now."""

    ready: int = 0
    starting: int = 0
    draining: int = 0

    @property
    def active(self) -> int:
        return self.ready + self.starting


@dataclass
class Plan:
    wanted: int
    order: list[str]  # the allowed pools, preferred first
    ideal: dict[str, int]  # where the wanted replicas belong
    kept: dict[str, int]  # beyond the ideal, kept until the replacements are ready
    targets: dict[str, int]  # replicas (ready + starting) each pool should hold: ideal + kept
    room: dict[str, int]  # what each allowed pool could take for this deployment
    short: int  # wanted replicas that no allowed pool can take
    next_cold_start_s: float | None  # cold start of the pool the next replica would go to

    def steps(self, held: dict[str, Held]) -> list[tuple[str, int]]:
        """(pool, target) to act on: pools gaining replicas first (so a refusal is known before
        anything drains), in the order of preference, then the others."""
        pools = self.order + [p for p in self.targets if p not in self.order]
        ups = [(p, self.targets[p]) for p in pools if self.targets[p] > held.get(p, Held()).active]
        rest = [(p, self.targets[p]) for p in pools if self.targets[p] <= held.get(p, Held()).active]
        return ups + rest

    def describe(self) -> str:
        """Where the replicas go and why, for logs and `strata status`: "spot 3 (full), ondemand 2"."""
        pools = self.order + [p for p in self.targets if p not in self.order]
        last_used = max((i for i, p in enumerate(pools) if self.targets.get(p)), default=-1)
        parts = []
        for i, p in enumerate(pools):
            n = self.targets.get(p, 0)
            full = p in self.room and self.ideal.get(p, 0) >= self.room[p]
            if not n and not (full and i < last_used):  # an empty pool matters when others took its share
                continue
            notes = (["full"] if full else []) + ([f"{self.kept[p]} until replaced"] if self.kept.get(p) else [])
            parts.append(f"{p} {n}" + (f" ({', '.join(notes)})" if notes else ""))
        text = ", ".join(parts) or "nothing placed"
        return f"{text}; short {self.short}" if self.short else text


@dataclass
class Backoff:
    refusals: int = 0  # in a row
    total: int = 0  # since this placer started
    until: float = 0.0  # while now < until the pool holds at most `held`
    held: int = 0  # replicas the pool held (every deployment) when it refused
    reason: str = ""


class Placer:
    """Stateful: keeps each pool's back-off. One per scaler (pools are shared by deployments)."""

    def __init__(self, backoff_s: float = 30.0, max_backoff_s: float = 600.0):
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(f"backoff_s must be positive and max_backoff_s at least as long "
                             f"(got {backoff_s}, {max_backoff_s})")
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.backoffs: dict[str, Backoff] = {}

    # ---- refusals ---------------------------------------------------------------------------
    def refused(self, pool: str, now: float, held: int, reason: str) -> float:
        """The pool refused or could not place; it holds `held` replicas (every deployment).
        Returns the back-off in seconds."""
        b = self.backoffs.setdefault(pool, Backoff())
        b.refusals += 1
        b.total += 1
        delay = min(self.backoff_s * 2 ** (b.refusals - 1), self.max_backoff_s)
        b.until, b.held, b.reason = now + delay, max(held, 0), reason
        return delay

    def observe(self, pool: str, ready: int, now: float) -> None:
        """The pool holds `ready` ready replicas (every deployment): beyond what it held when it
        last refused, after its back-off, it has capacity again and the refusals in a row end."""
        b = self.backoffs.get(pool)
        if b is not None and b.refusals and now >= b.until and ready > b.held:
            b.refusals = 0

    def backoff_left(self, pool: str, now: float) -> float:
        b = self.backoffs.get(pool)
        return max(b.until - now, 0.0) if b is not None else 0.0

    def refusals(self, pool: str) -> int:
        b = self.backoffs.get(pool)
        return b.total if b is not None else 0

    def last_refusal(self, pool: str) -> str:
        b = self.backoffs.get(pool)
        return b.reason if b is not None else ""

    def capacity(self, pool: PoolLike, now: float) -> int:
        """The replicas placement may put in the pool now: its capacity, or while backed off
        what it held when it refused."""
        b = self.backoffs.get(pool.name)
        if b is not None and now < b.until:
            return min(pool.capacity, b.held)
        return pool.capacity

    # ---- placement --------------------------------------------------------------------------
    def place(self, wanted: int, pools: Iterable[PoolLike], held: dict[str, Held], others: dict[str, int],
              prefs: Placement, now: float) -> Plan:
        """Where `wanted` replicas of one deployment (revision) go. `held`: what each pool holds
        of it now; `others`: replicas other deployments hold in each pool (alive: ready,
        starting or draining)."""
        pools = list(pools)
        order = preference_order(pools, prefs)
        by_name = {p.name: p for p in pools}
        room = {p: max(self.capacity(by_name[p], now) - others.get(p, 0) - held.get(p, Held()).draining, 0)
                for p in order}
        ideal = dict.fromkeys(order, 0)
        left = max(wanted, 0)
        if prefs.prefer == "pinned":
            for p, quota in shares(left, {p: s for p, s in prefs.shares.items() if p in room}).items():
                ideal[p] = min(quota, room[p])
            left -= sum(ideal.values())
        for p in order:
            take = min(room[p] - ideal[p], left)
            ideal[p] += take
            left -= take
        _spread(ideal, room, order, min(prefs.min_pools, max(wanted, 0)))
        next_pool = next((p for p in order if room[p] > ideal[p]), None)

        # Make-before-break: keep replicas beyond the ideal while ideal slots are not ready.
        everywhere = order + sorted(p for p, h in held.items() if p not in ideal and (h.active or h.draining))
        missing = sum(ideal.values()) - sum(min(held.get(p, Held()).ready, ideal.get(p, 0)) for p in everywhere)
        kept: dict[str, int] = {}
        for p in everywhere:
            extra = held.get(p, Held()).ready - ideal.get(p, 0)
            if extra > 0 and missing > 0:
                kept[p] = min(extra, missing)
                missing -= kept[p]
        targets = {p: ideal.get(p, 0) + kept.get(p, 0) for p in everywhere}
        return Plan(wanted=max(wanted, 0), order=order, ideal=ideal, kept=kept, targets=targets, room=room,
                    short=left, next_cold_start_s=by_name[next_pool].cold_start_s if next_pool else None)


def allowed(pools: Iterable[PoolLike], prefs: Placement) -> list[PoolLike]:
    """The pools the deployment may use: those it names (all when it names none) that carry
    every label it asks for."""
    return [p for p in pools if (not prefs.pools or p.name in prefs.pools)
            and all(p.labels.get(k) == v for k, v in prefs.labels.items())]


def preference_order(pools: Iterable[PoolLike], prefs: Placement) -> list[str]:
    def cost(p: PoolLike) -> tuple:
        return p.cost_per_hour, p.cold_start_s, p.name

    usable = allowed(pools, prefs)
    if prefs.prefer == "nearest":
        return [p.name for p in sorted(usable, key=lambda p: (p.region != prefs.region, *cost(p)))]
    return [p.name for p in sorted(usable, key=cost)]


def shares(total: int, percents: dict[str, int]) -> dict[str, int]:
    """`total` replicas split by percent, largest remainder first (ties by name)."""
    if not percents or total <= 0:
        return dict.fromkeys(percents, 0)
    scale = sum(percents.values()) or 1
    exact = {p: total * pct / scale for p, pct in percents.items()}
    out = {p: int(x) for p, x in exact.items()}
    for p in sorted(exact, key=lambda p: (-(exact[p] - out[p]), p))[:total - sum(out.values())]:
        out[p] += 1
    return out


def _spread(ideal: dict[str, int], room: dict[str, int], order: list[str], min_pools: int) -> None:
    """Until `min_pools` pools hold a replica, the pool holding the most gives one to the first
    empty pool in the order with room (availability: one pool's loss is not the whole fleet)."""
    while sum(n > 0 for n in ideal.values()) < min_pools:
        empty = next((p for p in order if ideal[p] == 0 and room[p] > 0), None)
        donor = max((p for p in order if ideal[p] > 1), key=lambda p: ideal[p], default=None)
        if empty is None or donor is None:
            return
        ideal[donor] -= 1
        ideal[empty] += 1
