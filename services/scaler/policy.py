"""The autoscaling policy: from a deployment's recent signals to a desired replica count.

Pure logic, no I/O and no clock: the scaler service feeds it measured signals on a monotonic
clock, the simulator feeds it simulated ones; both get the same decisions. The shape is Knative's
KPA (as AIBrix also uses it), adapted to LLM serving:

- demand is the requests a deployment holds: running and waiting in engines plus queued in the
  schedulers; one replica should carry `target_concurrency` of them;
- a short (panic) window scales up quickly; a long (stable) window and a scale-down delay decide
  when to give replicas back, so a dip between two waves does not stop replicas that are needed
  again a minute later (a replica costs a cold start to bring back);
- a burst of at least `panic_threshold` times what the ready replicas carry enters panic mode:
  no scale-down at all until the burst has been gone for a whole stable window;
- the SLO is on time to first token: a queue older than a fraction of the SLO means every queued
  request needs capacity that does not exist yet (less what the starting replicas will bring), and
  a TTFT p90 over the SLO or a nearly full KV cache is saturation: add a step of replicas;
- from zero, a queued request asks for a replica at once; to zero only when min_replicas is 0 and
  nothing has come for `scale_to_zero_after_s`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields


@dataclass
class ScalingConfig:
    min_replicas: int = 1
    max_replicas: int = 8
    target_concurrency: float = 16.0  # requests (running+waiting+queued) one replica should carry
    ttft_slo_s: float = 2.0  # the deployment's TTFT SLO
    stable_window_s: float = 60.0  # Knative-style averaging window
    panic_window_s: float = 6.0  # short window; panic when it asks for >= panic_threshold x ready
    panic_threshold: float = 2.0
    scale_down_delay_s: float = 30.0  # no scale-down until desired has been lower this long
    scale_to_zero_after_s: float = 120.0  # idle period before going to 0 (only if min_replicas == 0)
    cold_start_s: float = 10.0  # replica start time estimate (the service measures and updates it)
    queue_wait_fraction: float = 0.25  # a queue older than this fraction of the SLO needs replicas
    kv_high: float = 0.9  # mean KV-cache usage above this counts as saturation
    saturation_step: float = 0.1  # while saturated, add this fraction of the ready replicas (>= 1)
    trend_z: float = 3.0  # a rise counts as a trend beyond trend_z x sqrt(demand) (count noise)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes no sense."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
            if value < 0:
                raise ValueError(f"{f.name} must not be negative, got {value!r}")
        for name in ("min_replicas", "max_replicas"):
            if int(getattr(self, name)) != getattr(self, name):
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas must be at least 1, got {self.max_replicas}")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        for name in ("target_concurrency", "ttft_slo_s", "stable_window_s", "panic_window_s", "saturation_step"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.panic_window_s > self.stable_window_s:
            raise ValueError(f"panic_window_s ({self.panic_window_s}) must not exceed stable_window_s "
                             f"({self.stable_window_s})")
        if self.panic_threshold <= 1:
            raise ValueError(f"panic_threshold must be above 1, got {self.panic_threshold!r}")
        if not 0 < self.kv_high <= 1:
            raise ValueError(f"kv_high must be in (0, 1], got {self.kv_high!r}")


@dataclass
class Signals:
    now: float  # seconds (monotonic clock in the service, simulated time in the simulator)
    ready: int  # replicas ready to serve
    starting: int  # replicas started but not ready yet
    running: int  # requests running in engines (sum over replicas)
    waiting: int  # requests waiting inside engines
    queue_depth: int  # requests waiting in the schedulers' admission queues
    oldest_wait_s: float = 0.0  # age of the oldest queued request
    kv_usage: float = 0.0  # mean KV-cache usage over ready replicas, 0..1
    ttft_p90_s: float | None = None  # recent TTFT p90 (None: no data)

    @property
    def demand(self) -> int:
        return self.running + self.waiting + self.queue_depth


@dataclass
class ScaleDecision:
    desired: int
    reason: str  # short and human-readable: "queue 40 > capacity", "panic: burst 3.1x", ...
    panic: bool = False


class ScalerPolicy:
    """Stateful: keeps the demand samples of the stable window and the recent raw desires."""

    def __init__(self, config: ScalingConfig):
        config.validate()
        self.config = config
        self._samples: deque[tuple[float, int]] = deque()  # (now, demand), oldest first
        self._wanted: deque[tuple[float, int]] = deque()  # (now, raw desired) over the scale-down delay
        self._last_burst: float | None = None  # when the panic condition last held
        self._last_demand: float | None = None  # when demand was last above zero
        self._desired: int | None = None  # the previous decision

    def update_config(self, config: ScalingConfig) -> None:
        """New bounds, SLO or windows; the history is kept (the windows simply apply anew)."""
        config.validate()
        self.config = config

    def decide(self, s: Signals) -> ScaleDecision:
        cfg = self.config
        demand = s.demand
        self._record(s.now, demand)
        if demand > 0 or self._last_demand is None:
            self._last_demand = s.now
        stable_avg = self._mean(s.now - cfg.stable_window_s, s.now)
        panic_avg = self._mean(s.now - cfg.panic_window_s, s.now)
        per = cfg.target_concurrency

        burst = panic_avg / (per * max(s.ready, 1))
        if panic_avg > 0 and burst >= cfg.panic_threshold:
            self._last_burst = s.now
        panic = self._in_panic_at(s.now)

        # Every term proposes a fleet size (ready + starting); the largest wins.
        wants = [(math.ceil(stable_avg / per - 1e-9), f"stable: demand {stable_avg:.1f} over {cfg.stable_window_s:g}s"),
                 (math.ceil(panic_avg / per - 1e-9), f"panic: burst {burst:.1f}x" if panic else
                  f"rising: demand {panic_avg:.1f} over {cfg.panic_window_s:g}s")]
        trend = self._trend(s.now)
        if trend > 0:  # a replica started now serves a cold start from now: size for then
            ahead = min(panic_avg + trend * cfg.cold_start_s, cfg.panic_threshold * panic_avg)
            wants.append((math.ceil(ahead / per - 1e-9), f"trend: +{trend:.1f}/s, {ahead:.0f} in {cfg.cold_start_s:g}s"))
        fleet = s.ready + s.starting
        if s.queue_depth > 0 and (s.ready == 0 or s.oldest_wait_s >= cfg.queue_wait_fraction * cfg.ttft_slo_s):
            # Queued requests found no room on any ready replica: each needs new capacity,
            # except what the replicas already starting will take.
            uncovered = s.queue_depth - s.starting * per
            if uncovered > 0 or fleet == 0:
                wants.append((fleet + max(1, math.ceil(uncovered / per)), f"queue {s.queue_depth} > capacity"))
        saturation = None
        if s.ready > 0 and s.kv_usage > cfg.kv_high:
            saturation = f"saturated: kv {s.kv_usage:.2f}"
        elif s.ready > 0 and s.ttft_p90_s is not None and s.ttft_p90_s > cfg.ttft_slo_s:
            saturation = f"ttft p90 {s.ttft_p90_s:.1f}s > slo {cfg.ttft_slo_s:g}s"
        if saturation and s.starting == 0:  # replicas on their way are the step already taken
            wants.append((s.ready + max(1, math.ceil(s.ready * cfg.saturation_step)), saturation))
        wanted, reason = max(reversed(wants), key=lambda w: w[0])  # ties: the more specific term
        raw = min(max(wanted, cfg.min_replicas), cfg.max_replicas)

        if self._desired is None:  # a (re)started scaler keeps the fleet it finds for a delay
            self._wanted.append((s.now, min(max(fleet, cfg.min_replicas), cfg.max_replicas)))
        self._wanted.append((s.now, raw))
        while self._wanted and self._wanted[0][0] < s.now - cfg.scale_down_delay_s:
            self._wanted.popleft()
        held = max(w for _, w in self._wanted)
        if panic and self._desired is not None:
            held = max(held, self._desired)  # in panic, never scale down
        desired = max(raw, held)
        if desired > raw:
            reason = f"{'panic' if panic else 'cooldown'}: hold {desired} (want {raw})"

        idle = s.now - self._last_demand
        if desired == 0 and fleet > 0 and idle < cfg.scale_to_zero_after_s:
            desired, reason = 1, f"idle {idle:.0f}s < {cfg.scale_to_zero_after_s:g}s: keep 1"
        elif desired == 0 and fleet > 0:
            reason = f"idle {idle:.0f}s: to zero"
        desired = min(max(desired, cfg.min_replicas), cfg.max_replicas)
        if wanted > cfg.max_replicas:
            reason = f"{reason} (at max {cfg.max_replicas})"
        self._desired = desired
        return ScaleDecision(desired, reason, panic)

    # ---- windows ----------------------------------------------------------------------------
    def _in_panic_at(self, now: float) -> bool:
        return self._last_burst is not None and now - self._last_burst < self.config.stable_window_s

    def _record(self, now: float, demand: int) -> None:
        self._samples.append((now, demand))
        while self._samples[0][0] <= now - self.config.stable_window_s:
            self._samples.popleft()

    def _mean(self, start: float, end: float) -> float | None:
        """Mean demand of the samples taken in (start, end]; None when there is none."""
        total = count = 0
        for t, d in reversed(self._samples):
            if t <= start:
                break
            if t <= end:
                total += d
                count += 1
        return total / count if count else None

    def _trend(self, now: float) -> float:
        """Demand growth per second, the panic window's mean against the one before it; zero
        unless the rise is beyond count noise (trend_z x sqrt of the earlier mean), so random
        wobble of a steady load does not start replicas."""
        w = self.config.panic_window_s
        recent, before = self._mean(now - w, now), self._mean(now - 2 * w, now - w)
        if recent is None or before is None or recent - before <= self.config.trend_z * math.sqrt(max(before, 1.0)):
            return 0.0
        return (recent - before) / w
