"""Fleet simulator: one deployment's replicas under a request trace, scaled by the same
`ScalerPolicy` the scaler service runs and routed by the same `Router` the scheduler runs.

Discrete events, one heap: a request's completion, a replica becoming ready, a scaler tick;
arrivals come straight from the sorted trace. Per request the cost is O(d), whatever the fleet
size: routing ranks a power-of-d sample (d=2 by default) of the replicas that have room with
`Router.least_loaded(sample)`, and a request's whole life on a replica is computed when it
starts (prefill after the replica's earlier prefills, then decode at a per-sequence speed), so
it needs one completion event, not one per token. Fleet-wide figures (running, waiting, KV)
are kept as running totals, so a scaler tick does not walk the fleet either. A day of traffic
for 1,000 replicas is a few million requests and runs in minutes on one core.

Replica model (`ReplicaModel`): prefill at `prefill_tokens_per_s`, one prompt at a time (a
request's prefill waits for the prefills before it on that replica); decode at
`decode_tokens_per_s` per sequence, flat up to `max_num_seqs` (decode is memory-bound);
a request reserves KV for prompt + output tokens while it runs and waits inside the engine when
the batch or the KV cache is full. The scheduler's rule decides between routing and queueing
(`ReplicaState.saturated`: a replica takes one request beyond a full batch), and its admission
queue is FIFO (one tenant, one class). A replica is paid from the moment it is started, serves
after `cold_start_s`, and on scale-down drains: it takes no new work and stops when its last
request ends. TTFT = time from arrival until the prompt's prefill ends; the SLO is on TTFT.

Three ways to provision, each run on the same trace:
- policy: `ScalerPolicy` ticking every `tick_s` on signals computed from the simulated fleet;
- fixed: enough replicas for the trace's peak load, all day;
- oracle: knows the future: at each tick it has exactly the replicas that the load of the
  coming ticks needs, starting them a cold start ahead and draining them as soon as the load
  falls. It runs at the same target concurrency per replica as the policy, so the ratio of
  replica-hours measures what not knowing the future costs, nothing else.

With capacity pools (`--pools FILE`) the count is placed across them by the scaler's own
placement policy (services/scaler/placement.py): each pool has a cost per replica-hour, a cold
start, a capacity as its spec says, and outages (what it really has for a while), which the
policy learns only when the pool refuses a start. An outage takes back the replicas beyond what
is left; their streams continue on other replicas from the tokens already delivered, as the
gateway's resume does. The scenarios are then pooled (every pool), single-pool (the preferred
pool alone: one actuator in one place) and the oracle, which also knows the outages ahead and
places on what each pool will really have; cost is replica-hours at each pool's price.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import random
import sys
import time
from array import array
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cached_property
from heapq import heappop, heappush, nsmallest
from pathlib import Path

import numpy as np

from services.scaler import traces
from services.scaler.placement import Held, Placer, PoolView, preference_order
from services.scaler.policy import ScaleDecision, ScalerPolicy, ScalingConfig, Signals
from services.scheduler.policy import ReplicaState, Router
from shared.deployments import Placement, parse_placement
from shared.pools import PoolSpecError, parse_pools

SCENARIOS = ("policy", "oracle", "fixed")
POOL_SCENARIOS = ("pooled", "single-pool", "oracle", "fixed")  # with --pools
STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"
_COMPLETE, _READY, _TICK, _CAPACITY = 0, 1, 2, 3
INF = float("inf")


@dataclass
class ReplicaModel:
    """One replica's speed and size; the defaults are a large model on one multi-GPU replica
    serving long generations (see docs/simulator.md)."""

    prefill_tokens_per_s: float = 10000.0
    decode_tokens_per_s: float = 20.0  # per sequence, flat up to max_num_seqs
    max_num_seqs: int = 24
    kv_capacity_tokens: int = 131072
    block_size: int = 16
    cold_start_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "max_num_seqs", "kv_capacity_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(f"kv_capacity_tokens must hold at least one block of {self.block_size} tokens")
        if self.cold_start_s < 0:
            raise ValueError(f"cold_start_s must not be negative, got {self.cold_start_s!r}")

    def service_s(self, prompt_tokens, output_tokens):
        """Time a request takes on an idle replica (scalars or numpy arrays)."""
        return prompt_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s

    def requests_per_s(self, sizes: traces.RequestSizes, concurrency: float) -> float:
        """Arrival rate one replica carries at `concurrency` requests in flight (Little's law)."""
        return concurrency / self.service_s(sizes.mean_prompt(), sizes.mean_output())


@dataclass(eq=False)
class SimPool:
    """A capacity pool in the simulation. Placement sees its spec (capacity, cost, cold start,
    region, labels); the pool really has what its `outages` leave (capacity falls to a figure
    for a while: quota taken back, spot capacity reclaimed), which placement learns only from
    refusals. `rtt_s` is added to the TTFT of the requests it serves (clients elsewhere)."""

    name: str
    capacity: int
    cost_per_hour: float = 1.0
    cold_start_s: float = 30.0
    region: str = ""
    labels: dict = field(default_factory=dict)
    outages: list = field(default_factory=list)  # (start_s, end_s, capacity)
    rtt_s: float = 0.0
    # During a run (a fresh copy per run: dataclasses.replace leaves these out).
    actual: int = field(init=False, default=0)
    ready: set = field(init=False, default_factory=set)
    starting: list = field(init=False, default_factory=list)
    draining: set = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        if self.capacity < 0 or self.cost_per_hour < 0 or self.cold_start_s < 0 or self.rtt_s < 0:
            raise ValueError(f"pool {self.name}: capacity, cost, cold start and rtt must not be negative")
        for start, end, cap in self.outages:
            if not 0 <= start < end or cap < 0:
                raise ValueError(f"pool {self.name}: an outage needs 0 <= start < end and capacity >= 0")
        self.actual = self.actual_capacity(0.0)

    def actual_capacity(self, t: float, until: float | None = None) -> int:
        """What the pool really has at t (the least over [t, until] when given)."""
        until = t if until is None else until
        return min([self.capacity] + [cap for start, end, cap in self.outages if start <= until and t < end])

    @property
    def alive(self) -> int:
        return len(self.ready) + len(self.starting) + len(self.draining)

    def view(self, capacity: int | None = None) -> PoolView:
        return PoolView(self.name, self.region, self.capacity if capacity is None else capacity, self.cost_per_hour,
                        self.cold_start_s, self.labels)


@dataclass(eq=False)
class SimReplica(ReplicaState):
    """The scheduler's view of a replica (what the Router ranks) plus what the engine would know."""

    started_at: float = 0.0
    stopped_at: float | None = None
    prefill_free_at: float = 0.0  # when its last admitted prompt finishes prefill
    engine_queue: deque = field(default_factory=deque)  # requests waiting inside the engine
    open_slot: int = -1  # its index in the fleet's list of replicas with room (-1: none)
    pool: SimPool | None = None
    requests: dict = field(default_factory=dict)  # running on it -> when its decode starts (for a move)
    preempted: bool = False  # its pool took it back: its pending completions are void

    __eq__ = object.__eq__  # one replica is itself only (sets of replicas, list.remove)
    __hash__ = object.__hash__


class ScheduleScaler:
    """Replays a replica count per tick (the oracle, and fixed provisioning)."""

    def __init__(self, counts: np.ndarray, tick_s: float, reason: str):
        self.counts = counts
        self.tick_s = tick_s
        self.reason = reason

    def decide(self, s: Signals) -> ScaleDecision:
        b = min(round(s.now / self.tick_s), len(self.counts) - 1)
        return ScaleDecision(int(self.counts[b]), self.reason)


@dataclass
class SimResult:
    scenario: str
    metrics: dict
    timeline: dict  # per tick: t, ready, starting, draining, demand, queue (and pool:<name> with pools)
    ttft_s: np.ndarray
    arrival_s: np.ndarray


class FleetSim:
    """One run: a trace, a replica model and a scaler; `run()` plays it to the last request.

    Pools: the scaler's count is placed across `pools` by the placement policy
    (services.scaler.placement), refusals and make-before-break included. Without pools there
    is one pool without limit whose cost per replica-hour is 1 (cost = replica-hours).
    `foresight_s` > 0 (the oracle) places on what each pool really has over the coming
    `foresight_s` seconds instead of on its spec, so it never meets a refusal or a preemption."""

    def __init__(self, trace: traces.Trace, model: ReplicaModel, scaler, *, slo_ttft_s: float = 2.0,
                 tick_s: float = 2.0, initial_replicas: int = 1, route_choices: int = 2, seed: int = 0,
                 pools: list[SimPool] | None = None, placement: Placement | None = None, foresight_s: float = 0.0):
        if tick_s <= 0 or route_choices < 1:
            raise ValueError(f"tick_s must be positive and route_choices at least 1 (got {tick_s}, {route_choices})")
        self.trace, self.model, self.scaler = trace, model, scaler
        self.slo_ttft_s, self.tick_s, self.route_choices = slo_ttft_s, tick_s, route_choices
        self.router = Router(seed=seed)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.heap: list = []
        self._seq = itertools.count()
        kv_blocks = model.kv_capacity_tokens // model.block_size
        self.kv_blocks = kv_blocks
        tokens = trace.prompt_tokens + trace.output_tokens
        # Per request, as flat arrays: indexing them is quicker than numpy's in the event loop,
        # and they take 8 bytes a request where a list of floats takes 32.
        self.arrival = _flat("d", trace.arrival_s)
        self.blocks = _flat("q", np.minimum(-(-tokens // model.block_size), kv_blocks))
        self.prefill_s = _flat("d", trace.prompt_tokens / model.prefill_tokens_per_s)
        self.decode_s = _flat("d", trace.output_tokens / model.decode_tokens_per_s)
        self.ttft = _flat("d", np.zeros(len(trace)))
        self.wait = _flat("d", np.zeros(len(trace)))
        self.resumed = bytearray(len(trace))  # 1: a continuation (its first token was delivered already)
        self.requeued_at: dict[int, float] = {}  # continuations: when they joined the queue
        self.interrupted = 0
        self.done = 0
        # The fleet, by pool.
        self.pools = [dataclasses.replace(p) for p in pools] if pools else [
            SimPool("default", capacity=2**62, cost_per_hour=1.0, cold_start_s=model.cold_start_s)]
        self.pool_by_name = {p.name: p for p in self.pools}
        self.placement = placement or Placement()
        self.placer = Placer()
        self.foresight_s = foresight_s
        self.replicas: list[SimReplica] = []  # every replica ever started, for the bill
        self.open: list[SimReplica] = []  # ready replicas with room, O(1) add/remove/sample
        self.queue: deque[int] = deque()  # the scheduler's admission queue (request indices)
        self.running_total = self.waiting_total = self.kv_used_total = 0
        self.recent_ttft: list[float] = []
        self.timeline: dict[str, list] = {k: [] for k in ("t", "ready", "starting", "draining", "demand", "queue")}
        if pools:
            self.timeline.update({f"pool:{p.name}": [] for p in self.pools})
        self._next_cold_start: float | None = None
        self._place(initial_replicas, ready_now=True)
        for pool in self.pools:  # capacity changes: when outages start and end
            for t in sorted({x for start, end, _ in pool.outages for x in (start, end)}):
                heappush(self.heap, (t, next(self._seq), _CAPACITY, pool, 0))

    # ---- the event loop ---------------------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        heap, arrival, n, end = self.heap, self.arrival, len(self.arrival), self.trace.duration_s
        heappush(heap, (0.0, next(self._seq), _TICK, None, 0))
        i = 0
        while self.done < n or heap[0][0] <= end:  # every request ends; ticks cover the duration
            t_next = arrival[i] if i < n else INF
            if heap[0][0] <= t_next:
                t, _, kind, rep, req = heappop(heap)
                self.now = t
                if kind == _COMPLETE:
                    if not rep.preempted:  # a preempted replica's requests went elsewhere
                        self._complete(rep, req)
                elif kind == _READY:
                    self._ready(rep)
                elif kind == _CAPACITY:
                    self._capacity_changed(rep)
                else:
                    self._tick()
            else:
                self.now = t_next
                if self.queue or not self.open:
                    self.queue.append(i)
                else:
                    self._route(i)
                i += 1
        return self._result(time.perf_counter() - wall)

    def _route(self, req: int) -> None:
        """Power of d choices: Router ranks d replicas drawn from those with room."""
        open_, d = self.open, self.route_choices
        k = len(open_)
        if k > d:
            rand = self.rng.random
            sample = [open_[int(rand() * k)] for _ in range(d)]
        else:
            sample = open_
        rep = self.router.least_loaded(sample)
        if rep.running < rep.max_num_seqs and not rep.engine_queue and \
                rep.kv_blocks_used + self.blocks[req] <= rep.kv_blocks_total:
            self._run(rep, req)
        else:
            rep.engine_queue.append(req)
            rep.waiting += 1
            self.waiting_total += 1
        self._refresh(rep)

    def _run(self, rep: SimReplica, req: int) -> None:
        """req starts on rep: its prefill follows the replica's earlier ones, then it decodes."""
        now = self.now
        rep.running += 1
        self.running_total += 1
        blocks = self.blocks[req]
        rep.kv_blocks_used += blocks
        self.kv_used_total += blocks
        start = max(now, rep.prefill_free_at)
        first_token = start + self.prefill_s[req]
        rep.prefill_free_at = first_token
        rep.requests[req] = first_token
        if self.resumed[req]:  # a continuation: its first token was delivered before its move
            self.requeued_at.pop(req, None)
        else:
            self.wait[req] = now - self.arrival[req]
            ttft = first_token - self.arrival[req] + rep.pool.rtt_s
            self.ttft[req] = ttft
            self.recent_ttft.append(ttft)
        heappush(self.heap, (first_token + self.decode_s[req], next(self._seq), _COMPLETE, rep, req))

    def _complete(self, rep: SimReplica, req: int) -> None:
        self.done += 1
        rep.running -= 1
        self.running_total -= 1
        del rep.requests[req]
        blocks = self.blocks[req]
        rep.kv_blocks_used -= blocks
        self.kv_used_total -= blocks
        q = rep.engine_queue
        while q and rep.running < rep.max_num_seqs and rep.kv_blocks_used + self.blocks[q[0]] <= rep.kv_blocks_total:
            rep.waiting -= 1
            self.waiting_total -= 1
            self._run(rep, q.popleft())
        if rep.state == DRAINING and not rep.running and not q:
            self._stop(rep)
        else:
            self._refresh(rep)
        self._dispatch()

    def _dispatch(self) -> None:
        """Queued requests go out, oldest first, while some replica has room."""
        queue = self.queue
        while queue and self.open:
            self._route(queue.popleft())

    def _refresh(self, rep: SimReplica) -> None:
        """Keep the list of replicas with room in step with rep (the scheduler's saturation rule)."""
        has_room = rep.state == READY and not rep.saturated
        if has_room and rep.open_slot < 0:
            rep.open_slot = len(self.open)
            self.open.append(rep)
        elif not has_room and rep.open_slot >= 0:
            last = self.open.pop()
            if last is not rep:
                last.open_slot = rep.open_slot
                self.open[rep.open_slot] = last
            rep.open_slot = -1

    # ---- the fleet --------------------------------------------------------------------------
    def _start_replica(self, pool: SimPool, ready_now: bool = False) -> None:
        m = self.model
        rep = SimReplica(f"r{len(self.replicas)}", state=STARTING, kv_blocks_total=self.kv_blocks,
                         max_num_seqs=m.max_num_seqs, block_size=m.block_size, pool=pool,
                         started_at=self.now - (pool.cold_start_s if ready_now else 0.0))
        self.replicas.append(rep)
        pool.starting.append(rep)
        if ready_now:
            self._ready(rep)
        else:
            heappush(self.heap, (self.now + pool.cold_start_s, next(self._seq), _READY, rep, 0))

    def _ready(self, rep: SimReplica) -> None:
        if rep.state != STARTING:  # stopped before it was ready
            return
        rep.pool.starting.remove(rep)
        rep.state = READY
        rep.pool.ready.add(rep)
        self._refresh(rep)
        self._dispatch()

    def _stop(self, rep: SimReplica) -> None:
        rep.state = STOPPED
        rep.stopped_at = self.now
        rep.pool.draining.discard(rep)
        rep.pool.ready.discard(rep)
        self._refresh(rep)

    def _place(self, desired: int, ready_now: bool = False) -> None:
        """The placement policy splits `desired` across the pools; a pool that cannot start what
        it is asked (its real capacity is less than its spec) refuses, is backed off, and the
        count is placed again at once, as the scaler service does."""
        now = self.now
        if self.foresight_s > 0:
            views = [p.view(p.actual_capacity(now, now + self.foresight_s)) for p in self.pools]
        else:
            views = [p.view() for p in self.pools]
        for _ in range(len(self.pools) + 1):
            held = {p.name: Held(len(p.ready), len(p.starting), len(p.draining)) for p in self.pools}
            plan = self.placer.place(desired, views, held, {}, self.placement, now)
            refused = next((self.pool_by_name[name] for name, target in plan.steps(held)
                            if not self._scale_pool(self.pool_by_name[name], target, ready_now)), None)
            if refused is None:
                break
            self.placer.refused(refused.name, now, refused.alive, "no capacity")
        for p in self.pools:
            self.placer.observe(p.name, len(p.ready), now)
        self._next_cold_start = plan.next_cold_start_s

    def _scale_pool(self, pool: SimPool, target: int, ready_now: bool = False) -> bool:
        """Make `target` replicas ready or starting in the pool; False when it refused some."""
        current = len(pool.ready) + len(pool.starting)
        if target > current:
            fits = min(target - current, max(pool.actual - pool.alive, 0))
            for _ in range(fits):
                self._start_replica(pool, ready_now)
            return fits == target - current
        excess = current - target
        while excess > 0 and pool.starting:  # the newest starting replicas cost least to give up
            rep = pool.starting.pop()
            rep.state = STOPPED
            rep.stopped_at = self.now
            excess -= 1
        if excess > 0:  # drain the least loaded: they finish soonest (ids break ties: reproducible)
            for rep in nsmallest(excess, pool.ready, key=_drain_order):
                pool.ready.discard(rep)
                rep.state = DRAINING
                if rep.running or rep.engine_queue:
                    pool.draining.add(rep)
                    self._refresh(rep)
                else:
                    self._stop(rep)
        return True

    def _capacity_changed(self, pool: SimPool) -> None:
        """An outage starts or ends. Replicas beyond what the pool now has are taken back (the
        newest first); their streams continue elsewhere from the tokens already delivered (the
        gateway's resume), the requests waiting in them go back to the admission queue."""
        pool.actual = pool.actual_capacity(self.now)
        excess = pool.alive - pool.actual
        while excess > 0 and pool.starting:
            rep = pool.starting.pop()
            rep.state = STOPPED
            rep.stopped_at = self.now
            excess -= 1

        def newest(r: SimReplica) -> tuple:  # ids break ties: sets iterate in memory order
            return -r.started_at, r.replica_id

        victims = sorted(pool.draining, key=newest) + sorted(pool.ready, key=newest)
        for rep in victims[:max(excess, 0)]:
            self._preempt(rep)
        self._dispatch()

    def _preempt(self, rep: SimReplica) -> None:
        now, m = self.now, self.model
        for req, decode_from in rep.requests.items():
            self.running_total -= 1
            self.kv_used_total -= self.blocks[req]
            if now >= decode_from or self.resumed[req]:
                # Its stream goes on elsewhere: the continuation prefills the prompt plus the
                # tokens delivered so far, then decodes the rest (its TTFT stays what it was).
                done = min(max(now - decode_from, 0.0), self.decode_s[req])
                self.prefill_s[req] += done * m.decode_tokens_per_s / m.prefill_tokens_per_s
                self.decode_s[req] -= done
                self.resumed[req] = 1
                self.requeued_at[req] = now
                self.interrupted += 1
            self.queue.append(req)  # one still in its first prefill simply starts over
        self.queue.extend(rep.engine_queue)
        self.waiting_total -= len(rep.engine_queue)
        rep.requests.clear()
        rep.engine_queue.clear()
        rep.running = rep.waiting = rep.kv_blocks_used = 0
        rep.preempted = True
        self._stop(rep)

    def _tick(self) -> None:
        now = self.now
        queue = self.queue
        ready = sum(len(p.ready) for p in self.pools)
        starting = sum(len(p.starting) for p in self.pools)
        draining = sum(len(p.draining) for p in self.pools)
        serving = ready + draining
        recent = self.recent_ttft
        p90 = None
        if recent:
            recent.sort()
            p90 = recent[min(int(0.9 * len(recent)), len(recent) - 1)]
        oldest = self.requeued_at.get(queue[0], self.arrival[queue[0]]) if queue else now
        s = Signals(now=now, ready=ready, starting=starting, running=self.running_total,
                    waiting=self.waiting_total, queue_depth=len(queue), oldest_wait_s=now - oldest,
                    kv_usage=self.kv_used_total / (self.kv_blocks * serving) if serving else 0.0, ttft_p90_s=p90)
        self.recent_ttft = []
        if isinstance(self.scaler, ScalerPolicy) and self._next_cold_start is not None \
                and self._next_cold_start != self.scaler.config.cold_start_s:
            # The trend term sizes for one cold start ahead: that of the pool the next replicas go to.
            self.scaler.update_config(dataclasses.replace(self.scaler.config, cold_start_s=self._next_cold_start))
        self._place(self.scaler.decide(s).desired)
        tl = self.timeline
        tl["t"].append(now)
        tl["ready"].append(sum(len(p.ready) for p in self.pools))
        tl["starting"].append(sum(len(p.starting) for p in self.pools))
        tl["draining"].append(sum(len(p.draining) for p in self.pools))
        tl["demand"].append(s.demand)
        tl["queue"].append(len(queue))
        if "pool:" + self.pools[0].name in tl:
            for p in self.pools:
                tl["pool:" + p.name].append(p.alive)
        heappush(self.heap, (now + self.tick_s, next(self._seq), _TICK, None, 0))

    # ---- results ----------------------------------------------------------------------------
    def _result(self, wall_s: float) -> SimResult:
        end = self.trace.duration_s
        paid = {p.name: 0.0 for p in self.pools}
        for r in self.replicas:
            paid[r.pool.name] += max(0.0, min(end if r.stopped_at is None else r.stopped_at, end) - max(r.started_at, 0.0))
        paid_s = sum(paid.values())
        ttft, wait = np.frombuffer(self.ttft, np.float64), np.frombuffer(self.wait, np.float64)
        tl = {k: np.array(v) for k, v in self.timeline.items()}
        paid_now = tl["ready"] + tl["starting"] + tl["draining"]
        metrics = {
            "requests": len(ttft),
            "completed": self.done,
            "slo_attainment": float(np.mean(ttft <= self.slo_ttft_s)) if len(ttft) else 1.0,
            "replica_hours": paid_s / 3600,
            "cost": sum(paid[p.name] * p.cost_per_hour for p in self.pools) / 3600,
            "peak_replicas": int(paid_now.max()) if len(paid_now) else 0,
            "mean_replicas": paid_s / end if end else 0.0,
            "replicas_started": len(self.replicas),
            "queue_wait_s": _percentiles(wait),
            "ttft_s": _percentiles(ttft),
            "wall_s": wall_s,
        }
        if "pool:" + self.pools[0].name in tl:
            metrics["streams_moved"] = self.interrupted
            metrics["pools"] = {p.name: {"replica_hours": paid[p.name] / 3600,
                                         "cost": paid[p.name] * p.cost_per_hour / 3600,
                                         "peak_replicas": int(tl["pool:" + p.name].max()) if len(tl["t"]) else 0,
                                         "refusals": self.placer.refusals(p.name)} for p in self.pools}
        return SimResult("", metrics, tl, ttft, self.trace.arrival_s)


def _drain_order(r: SimReplica) -> tuple:
    return r.running + r.waiting, r.prefill_free_at, r.replica_id


def _flat(typecode: str, values: np.ndarray) -> array:
    return array(typecode, np.ascontiguousarray(values, dtype=np.float64 if typecode == "d" else np.int64).tobytes())


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


# ---- load profile, oracle, fixed --------------------------------------------------------------
def ideal_concurrency(trace: traces.Trace, model: ReplicaModel, bin_s: float) -> np.ndarray:
    """Most requests in flight during each bin if every request were served the moment it
    arrived, at an idle replica's speed: the load itself, free of any provisioning."""
    ends = trace.arrival_s + model.service_s(trace.prompt_tokens, trace.output_tokens)
    times = np.concatenate([trace.arrival_s, ends])
    steps = np.concatenate([np.ones(len(ends), np.int64), -np.ones(len(ends), np.int64)])
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(steps[order])
    n_bins = math.ceil(max(trace.duration_s, times[-1] if len(times) else 0.0) / bin_s) + 1
    peak = np.zeros(n_bins, np.int64)
    if len(times):
        np.maximum.at(peak, (times / bin_s).astype(np.int64), level)
        before = np.searchsorted(times, np.arange(n_bins) * bin_s, side="right") - 1
        peak = np.maximum(peak, np.where(before >= 0, level[np.maximum(before, 0)], 0))
    return peak


def oracle_counts(load: np.ndarray, cfg: ScalingConfig, cold_start_s: float, tick_s: float) -> np.ndarray:
    """Replicas per tick for the oracle: at tick b, the most the load needs until a replica
    started at the next tick could be ready (what is needed then must be started now)."""
    need = np.ceil(load / cfg.target_concurrency).astype(np.int64)
    ahead = math.ceil((cold_start_s + tick_s) / tick_s) + 1
    padded = np.concatenate([need, np.full(ahead - 1, need[-1] if len(need) else 0)])
    counts = np.lib.stride_tricks.sliding_window_view(padded, ahead).max(axis=1)
    return np.clip(counts, cfg.min_replicas, cfg.max_replicas)


def fixed_count(load: np.ndarray, cfg: ScalingConfig) -> int:
    """Enough replicas for the peak load (at the target concurrency), all day."""
    return int(min(max(math.ceil(load.max() / cfg.target_concurrency), cfg.min_replicas, 1), cfg.max_replicas))


# ---- one experiment ---------------------------------------------------------------------------
@dataclass
class Experiment:
    trace: traces.Trace
    model: ReplicaModel
    scaling: ScalingConfig
    slo_ttft_s: float = 2.0
    tick_s: float = 2.0
    route_choices: int = 2
    seed: int = 0
    pools: list[SimPool] | None = None  # capacity pools (None: one without limit)
    placement: Placement = field(default_factory=Placement)

    @cached_property
    def load(self) -> np.ndarray:
        """Requests in flight per tick if each were served at once (computed once per trace)."""
        return ideal_concurrency(self.trace, self.model, self.tick_s)

    @property
    def scenarios(self) -> tuple[str, ...]:
        return POOL_SCENARIOS if self.pools else SCENARIOS

    @property
    def cold_start_s(self) -> float:
        """The cold start the oracle plans for: the longest of any pool it may use."""
        return max(p.cold_start_s for p in self.pools) if self.pools else self.model.cold_start_s

    def run(self, scenario: str) -> SimResult:
        if scenario not in self.scenarios:
            raise ValueError(f"unknown scenario {scenario!r} (one of {', '.join(self.scenarios)})")
        load = self.load
        oracle = oracle_counts(load, self.scaling, self.cold_start_s, self.tick_s)
        pools, foresight = self.pools, 0.0
        if scenario in ("policy", "pooled", "single-pool"):
            scaler = ScalerPolicy(dataclasses.replace(self.scaling))
        elif scenario == "oracle":
            scaler = ScheduleScaler(oracle, self.tick_s, "oracle")
            foresight = self.cold_start_s + 2 * self.tick_s if pools else 0.0
        else:
            scaler = ScheduleScaler(np.array([fixed_count(load, self.scaling)]), self.tick_s, "fixed")
        if scenario == "single-pool":  # what one actuator in one place does: the preferred pool alone
            first = preference_order([p.view() for p in pools], self.placement)[0]
            pools = [p for p in pools if p.name == first]
        initial = int(oracle[0]) if scenario != "fixed" else fixed_count(load, self.scaling)
        sim = FleetSim(self.trace, self.model, scaler, slo_ttft_s=self.slo_ttft_s, tick_s=self.tick_s,
                       initial_replicas=initial, route_choices=self.route_choices, seed=self.seed,
                       pools=pools, placement=self.placement, foresight_s=foresight)
        result = sim.run()
        result.scenario = scenario
        return result


def _run_one(args: tuple[Experiment, str]) -> SimResult:
    experiment, scenario = args
    return experiment.run(scenario)


def run_all(experiment: Experiment, scenarios=None, jobs: int = 1) -> dict[str, SimResult]:
    """Each scenario (default: all of the experiment's) on the same trace; `jobs` > 1 runs them
    in parallel processes (spawned: a forked copy of a process with threads, a test runner's or a
    service's, may hang on a lock one of them held)."""
    work = [(experiment, s) for s in scenarios or experiment.scenarios]
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(min(jobs, len(work)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_run_one, work))
    else:
        results = [_run_one(w) for w in work]
    return {r.scenario: r for r in results}


# ---- reports ----------------------------------------------------------------------------------
def summary(experiment: Experiment, results: dict[str, SimResult], load: np.ndarray, wall_s: float) -> dict:
    """The JSON report: configuration, per-scenario figures, the policy against the oracle, and a
    per-minute timeline for plotting elsewhere."""
    out = {
        "trace": {"name": experiment.trace.name, "requests": len(experiment.trace),
                  "duration_s": experiment.trace.duration_s,
                  "peak_load_replicas": float(load.max() / experiment.scaling.target_concurrency)},
        "model": asdict(experiment.model),
        "scaling": asdict(experiment.scaling),
        "slo_ttft_s": experiment.slo_ttft_s,
        "tick_s": experiment.tick_s,
        "route_choices": experiment.route_choices,
        "seed": experiment.seed,
        "wall_s": wall_s,
        "scenarios": {name: r.metrics for name, r in results.items()},
    }
    if "policy" in results and "oracle" in results:
        out["policy_vs_oracle_replica_hours"] = (results["policy"].metrics["replica_hours"]
                                                 / max(results["oracle"].metrics["replica_hours"], 1e-9))
    if experiment.pools:
        out["pools"] = [{k: v for k, v in asdict(p).items() if k not in ("ready", "starting", "draining", "actual")}
                        for p in experiment.pools]
        out["placement"] = asdict(experiment.placement)
        outages = [(start, end) for p in experiment.pools for start, end, _ in p.outages]
        for name, r in results.items():  # the requests that arrived while a pool was out
            during = np.zeros(len(r.arrival_s), dtype=bool)
            for start, end in outages:
                during |= (r.arrival_s >= start) & (r.arrival_s < end)
            out["scenarios"][name]["slo_attainment_in_outages"] = (
                float(np.mean(r.ttft_s[during] <= experiment.slo_ttft_s)) if during.any() else None)
        if "oracle" in results:
            oracle_cost = max(results["oracle"].metrics["cost"], 1e-9)
            for name, r in results.items():
                out["scenarios"][name]["cost_vs_oracle"] = r.metrics["cost"] / oracle_cost
    step = max(1, round(60 / experiment.tick_s))
    ticks = int(experiment.trace.duration_s // experiment.tick_s) + 1  # every run ticks this long
    out["timeline_per_minute"] = {
        "t": [float(t) for t in np.arange(0, ticks, step) * experiment.tick_s],
        "load_replicas": [float(x) for x in load[:ticks:step] / experiment.scaling.target_concurrency],
        **{name: [int(x) for x in _paid(r)[:ticks:step]] for name, r in results.items()},
    }
    for name, r in results.items():  # with pools: each scenario's replicas in each pool
        for key, series in r.timeline.items():
            if key.startswith("pool:"):
                out["timeline_per_minute"][f"{name}/{key[5:]}"] = [int(x) for x in series[:ticks:step]]
    return out


def _paid(r: SimResult) -> np.ndarray:
    """Replicas paid for at each tick: ready, starting and draining."""
    return r.timeline["ready"] + r.timeline["starting"] + r.timeline["draining"]


def table(report: dict) -> str:
    """The scenarios side by side, for a terminal."""
    rows = [("", *report["scenarios"].keys())]

    def row(label, fn):
        rows.append((label, *(fn(m) for m in report["scenarios"].values())))

    slo = report["slo_ttft_s"]
    row(f"TTFT <= {slo:g}s", lambda m: f"{100 * m['slo_attainment']:.2f}%")
    row("replica-hours", lambda m: f"{m['replica_hours']:,.0f}")
    if "pools" in report:
        if any(m["slo_attainment_in_outages"] is not None for m in report["scenarios"].values()):
            row("  arriving in outages", lambda m: f"{100 * m['slo_attainment_in_outages']:.2f}%")
        row("cost", lambda m: f"{m['cost']:,.0f}")
        if "oracle" in report["scenarios"]:
            row("cost vs oracle", lambda m: f"{m['cost_vs_oracle']:.3f}x")
        row("streams moved", lambda m: f"{m['streams_moved']:,}")
        row("pool refusals", lambda m: f"{sum(p['refusals'] for p in m['pools'].values()):,}")
    row("peak replicas", lambda m: f"{m['peak_replicas']}")
    row("mean replicas", lambda m: f"{m['mean_replicas']:.1f}")
    row("replica starts", lambda m: f"{m['replicas_started']:,}")
    for q in ("p50", "p90", "p99"):
        row(f"queue wait {q}", lambda m, q=q: f"{m['queue_wait_s'][q]:.2f}s")
    for q in ("p50", "p99"):
        row(f"TTFT {q}", lambda m, q=q: f"{m['ttft_s'][q]:.2f}s")
    row("sim time", lambda m: f"{m['wall_s']:.0f}s")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    t = report["trace"]
    head = (f"trace {t['name']}: {t['requests']:,} requests over {t['duration_s'] / 3600:g}h, "
            f"peak load {t['peak_load_replicas']:.0f} replicas")
    tail = []
    if "policy_vs_oracle_replica_hours" in report:
        tail.append(f"policy / oracle replica-hours: {report['policy_vs_oracle_replica_hours']:.3f}")
    return "\n".join([head, *lines, *tail])


def plot(experiment: Experiment, results: dict[str, SimResult], load: np.ndarray, path: Path) -> None:
    """Replicas of each scenario and the load over time; below, the share of requests within
    the SLO per 10 minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = 3600.0
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, height_ratios=[3, 1])
    t_load = np.arange(len(load)) * experiment.tick_s / hours
    top.fill_between(t_load, load / experiment.scaling.target_concurrency, color="0.85",
                     label="load (replicas at target concurrency)")
    colours = {"policy": "tab:blue", "oracle": "tab:green", "fixed": "tab:red"}
    for name, r in results.items():
        paid = _paid(r)
        top.plot(r.timeline["t"] / hours, paid, lw=0.8, color=colours.get(name),
                 label=f"{name}: {r.metrics['replica_hours']:,.0f} replica-h, "
                       f"{100 * r.metrics['slo_attainment']:.2f}% in SLO")
    top.set_ylabel("replicas")
    top.set_title(f"{experiment.trace.name} trace: {len(experiment.trace):,} requests, TTFT SLO "
                  f"{experiment.slo_ttft_s:g}s, cold start {experiment.model.cold_start_s:g}s")
    top.legend(loc="upper left", fontsize=8)
    _plot_attainment(bottom, experiment, results, colours)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pools(experiment: Experiment, results: dict[str, SimResult], load: np.ndarray, path: Path) -> None:
    """With pools: each scenario's replicas and the load; the pooled policy's replicas by pool
    with the outages shaded; the share of requests within the SLO per 10 minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = 3600.0
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(12, 9), sharex=True, height_ratios=[2.2, 2.2, 1])
    t_load = np.arange(len(load)) * experiment.tick_s / hours
    top.fill_between(t_load, load / experiment.scaling.target_concurrency, color="0.85",
                     label="load (replicas at target concurrency)")
    colours = {"pooled": "tab:blue", "single-pool": "tab:red", "oracle": "tab:green", "fixed": "tab:purple"}
    for name, r in results.items():
        top.plot(r.timeline["t"] / hours, _paid(r), lw=0.8, color=colours.get(name),
                 label=f"{name}: cost {r.metrics['cost']:,.0f}, {100 * r.metrics['slo_attainment']:.2f}% in SLO")
    top.set_ylabel("replicas")
    top.set_title(f"{experiment.trace.name} trace over {len(experiment.pools)} pools: {len(experiment.trace):,} "
                  f"requests, TTFT SLO {experiment.slo_ttft_s:g}s")
    top.legend(loc="upper left", fontsize=8)
    shown = results.get("pooled") or next(iter(results.values()))
    per_pool = [(k[5:], v) for k, v in shown.timeline.items() if k.startswith("pool:")]
    spec = {p.name: p for p in experiment.pools}
    middle.stackplot(shown.timeline["t"] / hours, *[v for _, v in per_pool],
                     labels=[f"{n} (${spec[n].cost_per_hour:g}/h, cold start {spec[n].cold_start_s:g}s, "
                             f"capacity {spec[n].capacity})" for n, _ in per_pool], alpha=0.8)
    for p in experiment.pools:
        for start, end, cap in p.outages:
            for ax in (top, middle):
                ax.axvspan(start / hours, end / hours, color="tab:red", alpha=0.08)
            middle.text(start / hours, middle.get_ylim()[1] * 0.92, f" {p.name} down to {cap}", fontsize=8,
                        color="tab:red")
    middle.set_ylabel(f"{shown.scenario}: replicas by pool")
    middle.legend(loc="upper left", fontsize=8)
    _plot_attainment(bottom, experiment, results, colours)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_attainment(ax, experiment: Experiment, results: dict[str, SimResult], colours: dict) -> None:
    """The share of requests within the SLO per 10 minutes, per scenario."""
    bin_s = 600.0
    n_bins = math.ceil(experiment.trace.duration_s / bin_s)
    for name, r in results.items():
        idx = np.minimum((r.arrival_s / bin_s).astype(np.int64), n_bins - 1)
        total = np.bincount(idx, minlength=n_bins)
        ok = np.bincount(idx, weights=(r.ttft_s <= experiment.slo_ttft_s), minlength=n_bins)
        share = np.divide(ok, total, out=np.ones(n_bins), where=total > 0)
        ax.step((np.arange(n_bins) + 0.5) * bin_s / 3600.0, 100 * share, where="mid", lw=0.8,
                color=colours.get(name), label=name)
    ax.set_ylabel("% in SLO / 10 min")
    ax.set_xlabel("hours")
    ax.set_ylim(top=100.5)


# ---- command line -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata simulate", description=(
        "Simulate a fleet of replicas under a request trace with the scaler's policy, against "
        "fixed provisioning and an oracle that knows the future; with --pools, over capacity pools."))
    p.add_argument("trace", help="steady, diurnal, bursty, or a trace file (CSV or JSONL: arrival_s, "
                                 "prompt_tokens, output_tokens)")
    p.add_argument("--replicas-max", type=int, default=1000, help="the scaler's upper bound")
    p.add_argument("--replicas-min", type=int, default=1, help="the scaler's lower bound")
    p.add_argument("--duration", type=float, help="seconds of traffic (default: a day for a generated trace, "
                                                  "all of a trace file)")
    p.add_argument("--peak-load", type=float, default=0.9,
                   help="synthetic traces peak at this fraction of --replicas-max replicas' worth of load")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    p.add_argument("--target-concurrency", type=float, default=16.0, help="requests one replica should carry")
    p.add_argument("--cold-start", type=float, default=30.0,
                   help="seconds from starting a replica to serving (with --pools: each pool's own)")
    p.add_argument("--tick", type=float, default=2.0, help="seconds between scaler decisions")
    p.add_argument("--prefill-tps", type=float, default=ReplicaModel.prefill_tokens_per_s,
                   help="prefill tokens per second per replica")
    p.add_argument("--decode-tps", type=float, default=ReplicaModel.decode_tokens_per_s,
                   help="decode tokens per second per sequence")
    p.add_argument("--max-num-seqs", type=int, default=ReplicaModel.max_num_seqs, help="batch limit per replica")
    p.add_argument("--kv-tokens", type=int, default=ReplicaModel.kv_capacity_tokens,
                   help="KV-cache capacity per replica, tokens")
    p.add_argument("--route-choices", type=int, default=2, help="replicas sampled per routing decision (d)")
    p.add_argument("--pools", metavar="FILE", help="capacity pools (YAML: the format `strata pools apply` reads, "
                                                   "plus outages; see docs/simulator.md)")
    p.add_argument("--scenarios", help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all), or with "
                                       f"--pools of {','.join(POOL_SCENARIOS)} (default: all but fixed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="run the scenarios in this many processes")
    p.add_argument("--out", help="directory for NAME.json and NAME.png")
    p.add_argument("--name", help="the report's file name in --out (default: simulate, or pools with --pools)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    return p


def load_pools(path: str | Path, load: np.ndarray, tick_s: float) -> tuple[list[SimPool], Placement]:
    """A pools file: `pools:` as control stores them (shared.pools), each with optional
    `outages: [{start_s, duration_s, capacity}]` (start_s may be `peak`: the outage is centred
    on the trace's peak load) and `rtt_s`; an optional `placement:` section as a deployment
    spec has. ValueError names the field."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or "pools" not in data or set(data) - {"pools", "placement"}:
        raise ValueError(f"{path}: must be a mapping with pools (a list) and optionally placement")
    errors: list[tuple[str, str]] = []
    placement = parse_placement(data.get("placement"), errors)
    try:
        specs = parse_pools(data["pools"], extra=("outages", "rtt_s"))
    except PoolSpecError as exc:
        errors.extend(exc.errors)
        specs = []
    peak_s = float(np.argmax(load)) * tick_s if len(load) else 0.0
    pools = []
    for spec, raw in zip(specs, data["pools"]):
        outages = []
        for i, o in enumerate(raw.get("outages") or []):
            where = f"pools.{spec.name}.outages[{i}]"
            if not isinstance(o, dict) or set(o) - {"start_s", "duration_s", "capacity"} or \
                    not {"start_s", "duration_s", "capacity"} <= set(o):
                errors.append((where, "needs start_s (seconds, or peak), duration_s and capacity"))
                continue
            start, duration, cap = o["start_s"], o["duration_s"], o["capacity"]
            if start == "peak" and isinstance(duration, (int, float)):
                start = max(peak_s - duration / 2, 0.0)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (start, duration, cap)) \
                    or start < 0 or duration <= 0 or cap < 0 or int(cap) != cap:
                errors.append((where, "start_s >= 0 (or peak), duration_s > 0, capacity a whole number >= 0"))
                continue
            outages.append((float(start), float(start + duration), int(cap)))
        rtt = raw.get("rtt_s", 0.0)
        if not isinstance(rtt, (int, float)) or isinstance(rtt, bool) or rtt < 0:
            errors.append((f"pools.{spec.name}.rtt_s", "must be seconds, 0 or more"))
            rtt = 0.0
        pools.append(SimPool(spec.name, spec.capacity, spec.cost_per_hour, spec.cold_start_s, spec.region,
                             dict(spec.labels), outages, float(rtt)))
    unknown = sorted((set(placement.pools) | set(placement.shares)) - {p.name for p in pools})
    if unknown and pools:
        errors.append(("placement.pools", f"names pools the file does not define: {', '.join(unknown)}"))
    if errors:
        raise ValueError(f"{path}: " + "; ".join(f"{f}: {r}" for f, r in errors))
    if not preference_order([p.view() for p in pools], placement):
        raise ValueError(f"{path}: placement allows none of the pools")
    return pools, placement


def experiment_from_args(args: argparse.Namespace) -> Experiment:
    """The experiment the command line describes (ValueError on a bad option, naming it)."""
    if args.tick <= 0:
        raise ValueError(f"--tick must be positive, got {args.tick}")
    if args.route_choices < 1:
        raise ValueError(f"--route-choices must be at least 1, got {args.route_choices}")
    model = ReplicaModel(prefill_tokens_per_s=args.prefill_tps, decode_tokens_per_s=args.decode_tps,
                         max_num_seqs=args.max_num_seqs, kv_capacity_tokens=args.kv_tokens,
                         cold_start_s=args.cold_start)
    scaling = ScalingConfig(min_replicas=args.replicas_min, max_replicas=args.replicas_max,
                            target_concurrency=args.target_concurrency, ttft_slo_s=args.slo_ttft,
                            cold_start_s=args.cold_start)
    if args.trace in traces.GENERATORS:
        sizes = traces.RequestSizes()
        peak_rate = args.peak_load * args.replicas_max * model.requests_per_s(sizes, args.target_concurrency)
        trace = traces.generate(args.trace, peak_rate, args.duration or traces.DAY_S, args.seed, sizes)
    else:
        trace = traces.load(args.trace, args.duration)
    experiment = Experiment(trace, model, scaling, slo_ttft_s=args.slo_ttft, tick_s=args.tick,
                            route_choices=args.route_choices, seed=args.seed)
    if args.pools:
        experiment.pools, experiment.placement = load_pools(args.pools, experiment.load, args.tick)
    return experiment


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wall = time.perf_counter()
    try:
        experiment = experiment_from_args(args)
    except (OSError, ValueError) as exc:
        print(f"strata simulate: {exc}", file=sys.stderr)
        return 2
    valid = experiment.scenarios
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()] if args.scenarios else \
        [s for s in valid if s != "fixed" or not experiment.pools]
    unknown = [s for s in scenarios if s not in valid]
    if unknown or not scenarios:
        print(f"unknown scenarios {unknown} (use {','.join(valid)})", file=sys.stderr)
        return 2
    load = experiment.load
    results = run_all(experiment, scenarios, args.jobs)
    command = " ".join(["strata simulate", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command, **summary(experiment, results, load, time.perf_counter() - wall)}
    name = args.name or ("pools" if experiment.pools else "simulate")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
        (plot_pools if experiment.pools else plot)(experiment, results, load, out / f"{name}.png")
    print(json.dumps(report, indent=1) if args.json else table(report))
    if args.out and not args.json:
        print(f"wrote {Path(args.out) / f'{name}.json'} and {Path(args.out) / f'{name}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
