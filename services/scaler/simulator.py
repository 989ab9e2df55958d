"""Fleet simulator: one deployment's replicas under a request trace, scaled by the same
`ScalerPolicy` the scaler service runs and routed by the same `Router` the scheduler runs.

Discrete events, one heap: a request's completion, a replica becoming ready, a scaler tick;
arrivals come straight from the sorted trace. Per request the cost is O(d), whatever the fleet
size: routing ranks a power-of-d sample (d=2 by default) of the replicas that have room with
`Router.rank("least_load", sample)`, and a request's whole life on a replica is computed when it
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
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
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
from services.scaler.policy import ScaleDecision, ScalerPolicy, ScalingConfig, Signals
from services.scheduler.policy import ReplicaState, Router

SCENARIOS = ("policy", "oracle", "fixed")
STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"
_COMPLETE, _READY, _TICK = 0, 1, 2
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
class SimReplica(ReplicaState):
    """The scheduler's view of a replica (what the Router ranks) plus what the engine would know."""

    started_at: float = 0.0
    stopped_at: float | None = None
    prefill_free_at: float = 0.0  # when its last admitted prompt finishes prefill
    engine_queue: deque = field(default_factory=deque)  # requests waiting inside the engine
    open_slot: int = -1  # its index in the fleet's list of replicas with room (-1: none)

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
    timeline: dict  # per tick: t, ready, starting, draining, demand, queue
    ttft_s: np.ndarray
    arrival_s: np.ndarray


class FleetSim:
    """One run: a trace, a replica model and a scaler; `run()` plays it to the last request."""

    def __init__(self, trace: traces.Trace, model: ReplicaModel, scaler, *, slo_ttft_s: float = 2.0,
                 tick_s: float = 2.0, initial_replicas: int = 1, route_choices: int = 2, seed: int = 0):
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
        self.done = 0
        # The fleet.
        self.replicas: list[SimReplica] = []  # every replica ever started, for the bill
        self.open: list[SimReplica] = []  # ready replicas with room, O(1) add/remove/sample
        self.ready: set[SimReplica] = set()
        self.starting: list[SimReplica] = []
        self.draining: set[SimReplica] = set()
        self.queue: deque[int] = deque()  # the scheduler's admission queue (request indices)
        self.running_total = self.waiting_total = self.kv_used_total = 0
        self.recent_ttft: list[float] = []
        self.timeline: dict[str, list] = {k: [] for k in ("t", "ready", "starting", "draining", "demand", "queue")}
        for _ in range(initial_replicas):
            self._start_replica(ready_now=True)

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
                    self._complete(rep, req)
                elif kind == _READY:
                    self._ready(rep)
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
        rep = self.router.rank("least_load", sample)[0].replica
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
        self.wait[req] = now - self.arrival[req]
        ttft = first_token - self.arrival[req]
        self.ttft[req] = ttft
        self.recent_ttft.append(ttft)
        heappush(self.heap, (first_token + self.decode_s[req], next(self._seq), _COMPLETE, rep, req))

    def _complete(self, rep: SimReplica, req: int) -> None:
        self.done += 1
        rep.running -= 1
        self.running_total -= 1
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
    def _start_replica(self, ready_now: bool = False) -> None:
        m = self.model
        rep = SimReplica(f"r{len(self.replicas)}", state=STARTING, kv_blocks_total=self.kv_blocks,
                         max_num_seqs=m.max_num_seqs, block_size=m.block_size,
                         started_at=self.now - (m.cold_start_s if ready_now else 0.0))
        self.replicas.append(rep)
        self.starting.append(rep)
        if ready_now:
            self._ready(rep)
        else:
            heappush(self.heap, (self.now + m.cold_start_s, next(self._seq), _READY, rep, 0))

    def _ready(self, rep: SimReplica) -> None:
        if rep.state != STARTING:  # stopped before it was ready
            return
        self.starting.remove(rep)
        rep.state = READY
        self.ready.add(rep)
        self._refresh(rep)
        self._dispatch()

    def _stop(self, rep: SimReplica) -> None:
        rep.state = STOPPED
        rep.stopped_at = self.now
        self.draining.discard(rep)
        self.ready.discard(rep)
        self._refresh(rep)

    def _scale_to(self, desired: int) -> None:
        current = len(self.ready) + len(self.starting)
        for _ in range(desired - current):
            self._start_replica()
        excess = current - desired
        while excess > 0 and self.starting:  # the newest starting replicas cost least to give up
            rep = self.starting.pop()
            rep.state = STOPPED
            rep.stopped_at = self.now
            excess -= 1
        if excess > 0:  # drain the least loaded: they finish soonest (ids break ties: reproducible)
            for rep in nsmallest(excess, self.ready, key=_drain_order):
                self.ready.discard(rep)
                rep.state = DRAINING
                if rep.running or rep.engine_queue:
                    self.draining.add(rep)
                    self._refresh(rep)
                else:
                    self._stop(rep)

    def _tick(self) -> None:
        now = self.now
        queue = self.queue
        serving = len(self.ready) + len(self.draining)
        recent = self.recent_ttft
        p90 = None
        if recent:
            recent.sort()
            p90 = recent[min(int(0.9 * len(recent)), len(recent) - 1)]
        s = Signals(now=now, ready=len(self.ready), starting=len(self.starting), running=self.running_total,
                    waiting=self.waiting_total, queue_depth=len(queue),
                    oldest_wait_s=now - self.arrival[queue[0]] if queue else 0.0,
                    kv_usage=self.kv_used_total / (self.kv_blocks * serving) if serving else 0.0, ttft_p90_s=p90)
        self.recent_ttft = []
        self._scale_to(self.scaler.decide(s).desired)
        tl = self.timeline
        tl["t"].append(now)
        tl["ready"].append(len(self.ready))
        tl["starting"].append(len(self.starting))
        tl["draining"].append(len(self.draining))
        tl["demand"].append(s.demand)
        tl["queue"].append(len(queue))
        heappush(self.heap, (now + self.tick_s, next(self._seq), _TICK, None, 0))

    # ---- results ----------------------------------------------------------------------------
    def _result(self, wall_s: float) -> SimResult:
        end = self.trace.duration_s
        paid_s = sum(max(0.0, min(end if r.stopped_at is None else r.stopped_at, end) - max(r.started_at, 0.0))
                     for r in self.replicas)
        ttft, wait = np.frombuffer(self.ttft, np.float64), np.frombuffer(self.wait, np.float64)
        tl = {k: np.array(v) for k, v in self.timeline.items()}
        paid = tl["ready"] + tl["starting"] + tl["draining"]
        metrics = {
            "requests": len(ttft),
            "completed": self.done,
            "slo_attainment": float(np.mean(ttft <= self.slo_ttft_s)) if len(ttft) else 1.0,
            "replica_hours": paid_s / 3600,
            "peak_replicas": int(paid.max()) if len(paid) else 0,
            "mean_replicas": paid_s / end if end else 0.0,
            "replicas_started": len(self.replicas),
            "queue_wait_s": _percentiles(wait),
            "ttft_s": _percentiles(ttft),
            "wall_s": wall_s,
        }
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

    @cached_property
    def load(self) -> np.ndarray:
        """Requests in flight per tick if each were served at once (computed once per trace)."""
        return ideal_concurrency(self.trace, self.model, self.tick_s)

    def run(self, scenario: str) -> SimResult:
        load = self.load
        oracle = oracle_counts(load, self.scaling, self.model.cold_start_s, self.tick_s)
        if scenario == "policy":
            scaler = ScalerPolicy(self.scaling)
        elif scenario == "oracle":
            scaler = ScheduleScaler(oracle, self.tick_s, "oracle")
        elif scenario == "fixed":
            scaler = ScheduleScaler(np.array([fixed_count(load, self.scaling)]), self.tick_s, "fixed")
        else:
            raise ValueError(f"unknown scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
        initial = int(oracle[0]) if scenario != "fixed" else fixed_count(load, self.scaling)
        sim = FleetSim(self.trace, self.model, scaler, slo_ttft_s=self.slo_ttft_s, tick_s=self.tick_s,
                       initial_replicas=initial, route_choices=self.route_choices, seed=self.seed)
        result = sim.run()
        result.scenario = scenario
        return result


def _run_one(args: tuple[Experiment, str]) -> SimResult:
    experiment, scenario = args
    return experiment.run(scenario)


def run_all(experiment: Experiment, scenarios=SCENARIOS, jobs: int = 1) -> dict[str, SimResult]:
    """Each scenario on the same trace; `jobs` > 1 runs them in parallel processes."""
    work = [(experiment, s) for s in scenarios]
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(min(jobs, len(work))) as pool:
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
    step = max(1, round(60 / experiment.tick_s))
    ticks = int(experiment.trace.duration_s // experiment.tick_s) + 1  # every run ticks this long
    out["timeline_per_minute"] = {
        "t": [float(t) for t in np.arange(0, ticks, step) * experiment.tick_s],
        "load_replicas": [float(x) for x in load[:ticks:step] / experiment.scaling.target_concurrency],
        **{name: [int(x) for x in _paid(r)[:ticks:step]] for name, r in results.items()},
    }
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
    bin_s = 600.0
    n_bins = math.ceil(experiment.trace.duration_s / bin_s)
    for name, r in results.items():
        idx = np.minimum((r.arrival_s / bin_s).astype(np.int64), n_bins - 1)
        total = np.bincount(idx, minlength=n_bins)
        ok = np.bincount(idx, weights=(r.ttft_s <= experiment.slo_ttft_s), minlength=n_bins)
        share = np.divide(ok, total, out=np.ones(n_bins), where=total > 0)
        bottom.step((np.arange(n_bins) + 0.5) * bin_s / hours, 100 * share, where="mid", lw=0.8,
                    color=colours.get(name), label=name)
    bottom.set_ylabel("% in SLO / 10 min")
    bottom.set_xlabel("hours")
    bottom.set_ylim(top=100.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata simulate", description=(
        "Simulate a fleet of replicas under a request trace with the scaler's policy, against "
        "fixed provisioning and an oracle that knows the future."))
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
    p.add_argument("--cold-start", type=float, default=30.0, help="seconds from starting a replica to serving")
    p.add_argument("--tick", type=float, default=2.0, help="seconds between scaler decisions")
    p.add_argument("--prefill-tps", type=float, default=ReplicaModel.prefill_tokens_per_s,
                   help="prefill tokens per second per replica")
    p.add_argument("--decode-tps", type=float, default=ReplicaModel.decode_tokens_per_s,
                   help="decode tokens per second per sequence")
    p.add_argument("--max-num-seqs", type=int, default=ReplicaModel.max_num_seqs, help="batch limit per replica")
    p.add_argument("--kv-tokens", type=int, default=ReplicaModel.kv_capacity_tokens,
                   help="KV-cache capacity per replica, tokens")
    p.add_argument("--route-choices", type=int, default=2, help="replicas sampled per routing decision (d)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of policy,oracle,fixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="run the scenarios in this many processes")
    p.add_argument("--out", help="directory for simulate.json and simulate.png")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    return p


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
    return Experiment(trace, model, scaling, slo_ttft_s=args.slo_ttft, tick_s=args.tick,
                      route_choices=args.route_choices, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        print(f"unknown scenarios {unknown} (use {','.join(SCENARIOS)})", file=sys.stderr)
        return 2
    wall = time.perf_counter()
    try:
        experiment = experiment_from_args(args)
    except (OSError, ValueError) as exc:
        print(f"strata simulate: {exc}", file=sys.stderr)
        return 2
    load = experiment.load
    results = run_all(experiment, scenarios, args.jobs)
    command = " ".join(["strata simulate", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command, **summary(experiment, results, load, time.perf_counter() - wall)}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulate.json").write_text(json.dumps(report, indent=1))
        plot(experiment, results, load, out / "simulate.png")
    print(json.dumps(report, indent=1) if args.json else table(report))
    if args.out and not args.json:
        print(f"wrote {Path(args.out) / 'simulate.json'} and {Path(args.out) / 'simulate.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
