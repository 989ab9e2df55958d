"""Fleet simulator for LoRA adapters: many adapters on one base model over a fixed fleet, routed
by the scheduler's own Router and packed by its placement policy (services.scheduler.
lora_placement), against round-robin and least-load routing that ignore adapters.

Replica model: `max_num_seqs` requests run at once, each for its service time; a batch holds
at most `max_loras` adapters (the engine's device slots, LRU). A request whose adapter is not
resident waits until a slot holds no running adapter, then pays a load: `slot_load_s` from the
host cache (`max_cpu_loras` adapters, LRU) or `disk_load_s` from disk. TTFT = queueing at the
replica + the load + prefill. Demand over adapters is Zipf (a few hot adapters, a long tail),
arrivals Poisson. Discrete events on one heap; routing looks at the placed replicas, the ones
holding the adapter and `route_choices` random others (power of d), so a request costs
O(placement + d), whatever the fleet.

    python -m services.scaler.lora_simulator --replicas 100 --adapters 1000
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from services.scheduler.lora_placement import DemandWindow, place_adapters, placed_replicas
from services.scheduler.policy import ReplicaState, Router

POLICIES = ("placement", "least_load", "round_robin")


@dataclass
class LoraFleet:
    replicas: int = 100
    adapters: int = 1000
    max_loras: int = 8
    max_cpu_loras: int = 64
    max_num_seqs: int = 32
    prefill_s: float = 0.05
    decode_s: float = 2.0  # mean time a request decodes (exponential)
    slot_load_s: float = 0.01
    disk_load_s: float = 0.2
    zipf_s: float = 1.1
    utilization: float = 0.6  # arrival rate as a share of the fleet's capacity
    duration_s: float = 120.0
    place_every_s: float = 1.0
    route_choices: int = 2
    seed: int = 0


@dataclass(eq=False)
class SimReplica(ReplicaState):
    slots: OrderedDict = field(default_factory=OrderedDict)  # resident adapter -> running requests (LRU order)
    host: OrderedDict = field(default_factory=OrderedDict)  # host-cached adapters (LRU)
    queue: deque = field(default_factory=deque)
    loads: int = 0
    disk_loads: int = 0

    __eq__ = object.__eq__
    __hash__ = object.__hash__


class LoraFleetSim:
    def __init__(self, cfg: LoraFleet, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.cfg, self.policy = cfg, policy
        self.rng = random.Random(cfg.seed)
        self.router = Router(seed=cfg.seed)
        self.fleet = [SimReplica(f"r{i}", max_num_seqs=cfg.max_num_seqs, max_loras=cfg.max_loras)
                      for i in range(cfg.replicas)]
        self.by_id = {r.replica_id: r for r in self.fleet}
        self.holders: dict[str, set[SimReplica]] = {}  # adapter -> replicas it is resident on
        self.placed: dict[str, set[str]] = {}
        self.demand = DemandWindow(half_life_s=30.0)
        self.heap: list = []
        self.seq = 0
        self.ttft: list[float] = []
        self.rr = 0

    def workload(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cfg = self.cfg
        g = np.random.default_rng(cfg.seed)
        capacity = cfg.replicas * cfg.max_num_seqs / (cfg.prefill_s + cfg.decode_s)
        rate = capacity * cfg.utilization
        n = int(rate * cfg.duration_s)
        arrivals = np.cumsum(g.exponential(1 / rate, n))
        weights = 1.0 / np.arange(1, cfg.adapters + 1) ** cfg.zipf_s
        adapters = g.choice(cfg.adapters, n, p=weights / weights.sum())
        return arrivals, adapters, g.exponential(cfg.decode_s, n)

    def _push(self, t: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def run(self) -> dict:
        wall = time.perf_counter()
        arrivals, adapters, decode = self.workload()
        names = [f"a{i}" for i in range(self.cfg.adapters)]
        next_place = 0.0
        i = 0
        while i < len(arrivals) or self.heap:
            t_arr = arrivals[i] if i < len(arrivals) else float("inf")
            if self.heap and self.heap[0][0] <= t_arr:
                now, _, _kind, (replica, adapter) = heapq.heappop(self.heap)
                self._complete(replica, adapter, now)
                continue
            now = t_arr
            if self.policy == "placement" and now >= next_place:
                self._place(now)
                next_place = now + self.cfg.place_every_s
            adapter = names[adapters[i]]
            self.demand.add(adapter, now)
            replica = self._route(adapter)
            replica.queue.append((now, adapter, float(decode[i])))
            self._admit(replica, now)
            i += 1
        ttft = np.array(self.ttft)
        loads = sum(r.loads for r in self.fleet)
        return {"policy": self.policy, "requests": len(ttft), "adapter_loads": loads,
                "loads_per_1k_requests": 1000 * loads / max(len(ttft), 1),
                "disk_loads": sum(r.disk_loads for r in self.fleet),
                "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3), "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
                "simulated_s": self.cfg.duration_s, "wall_s": time.perf_counter() - wall}

    def _place(self, now: float) -> None:
        placement = place_adapters(self.demand.demand(now), {r.replica_id: r.max_loras for r in self.fleet},
                                   {r.replica_id: set(r.slots) for r in self.fleet})
        self.placed = placed_replicas(placement)

    def _route(self, adapter: str) -> SimReplica:
        if self.policy == "round_robin":
            self.rr += 1
            return self.fleet[self.rr % len(self.fleet)]
        sample = {self.fleet[int(self.rng.random() * len(self.fleet))] for _ in range(self.cfg.route_choices)}
        if self.policy == "least_load":
            return self.router.least_loaded(list(sample))
        placed = self.placed.get(adapter, set())
        candidates = sample | {self.by_id[r] for r in placed} | self.holders.get(adapter, set())
        return self.router.rank("kv_aware", list(candidates), adapter=adapter, placed=placed)[0].replica

    def _admit(self, r: SimReplica, now: float) -> None:
        cfg = self.cfg
        kept = deque()
        while r.queue and r.running < r.max_num_seqs:
            arrival, adapter, decode_s = r.queue.popleft()
            load_s = 0.0
            if adapter not in r.slots:
                if len(r.slots) >= cfg.max_loras:
                    victim = next((a for a, n in r.slots.items() if n == 0), None)
                    if victim is None:  # every slot busy: it waits; later requests may still run
                        kept.append((arrival, adapter, decode_s))
                        continue
                    del r.slots[victim]
                    self.holders[victim].discard(r)
                load_s = cfg.slot_load_s if adapter in r.host else cfg.disk_load_s
                r.disk_loads += adapter not in r.host
                r.host[adapter] = None
                r.host.move_to_end(adapter)
                while len(r.host) > cfg.max_cpu_loras:
                    r.host.popitem(last=False)
                r.slots[adapter] = 0
                r.loads += 1
                self.holders.setdefault(adapter, set()).add(r)
            r.slots[adapter] += 1
            r.slots.move_to_end(adapter)
            r.running += 1
            self.ttft.append(now - arrival + load_s + cfg.prefill_s)
            self._push(now + load_s + cfg.prefill_s + decode_s, 0, (r, adapter))
        kept.extend(r.queue)
        r.queue = kept
        r.waiting = len(kept)
        r.lora_resident = frozenset(r.slots)
        r.lora_cached = frozenset(r.host)

    def _complete(self, r: SimReplica, adapter: str, now: float) -> None:
        r.running -= 1
        r.slots[adapter] -= 1
        self._admit(r, now)


def compare(cfg: LoraFleet, policies=POLICIES) -> dict:
    results = {p: LoraFleetSim(cfg, p).run() for p in policies}
    return {"config": asdict(cfg), "results": results}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in LoraFleet.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    out = compare(LoraFleet(**vars(args)))
    for r in out["results"].values():
        print(f"{r['policy']:12s} loads {r['adapter_loads']:7d} ({r['loads_per_1k_requests']:.1f}/1k requests)  "
              f"TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms  ({r['wall_s']:.1f} s)")
    print(json.dumps(out["results"], indent=1))


if __name__ == "__main__":
    main()
