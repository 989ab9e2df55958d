"""The fleet as control sees it: replicas (heartbeats), admission queues (scheduler stats) and
scaler decisions, aggregated per deployment, with a short history for the dashboard's charts.
Pure: messages in, figures out; the service feeds it from the bus.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from shared.layers import LAYERS as REQUEST_LAYERS
from shared.protocol import GatewayStats, Heartbeat, SchedulerStats, ScalerDecision

HISTORY_POINTS = 300  # samples kept per deployment (10 minutes at one every 2 s)
# The parts of a request's time by the component that owns them (shared.layers). Control, the
# tooling layer, is off the request path: its share is what deploys and config cost, not time.
LAYERS = {component: tuple(layer.name for layer in REQUEST_LAYERS if layer.component == component)
          for component in ("runtime", "infrastructure", "tooling")}


@dataclass
class Sample:
    at: float
    request_rate: float  # finished requests per second
    tokens_per_s: float
    ttft_p90_s: float | None
    itl_p50_s: float | None
    queue_depth: int
    ready: int
    running: int
    error_rate: float  # failed / finished, over the last interval
    by_revision: dict[int, dict[str, float]] = field(default_factory=dict)
    layer_totals: dict[str, float] = field(default_factory=dict)  # part -> seconds, over `completed`
    completed: int = 0  # requests the gateways completed in the interval


class FleetView:
    def __init__(self, stale_after: float = 5.0):
        self.stale_after = stale_after
        self.replicas: dict[str, tuple[float, Heartbeat]] = {}  # replica id -> (seen, last heartbeat)
        self.schedulers: dict[str, tuple[float, SchedulerStats]] = {}
        self.scaler: dict[tuple[str, int], ScalerDecision] = {}
        self.gateways: dict[str, tuple[float, str]] = {}  # gateway id -> (seen, http url)
        self._layers: dict[str, dict[str, float]] = {}  # model -> part -> seconds, since the last sample
        self._completed: dict[str, int] = {}
        self.history: dict[str, deque[Sample]] = {}
        self._last_counts: dict[str, tuple[int, int]] = {}  # replica id -> (finished, failed) at last sample
        self._last_sample_at: float | None = None

    def on_heartbeat(self, hb: Heartbeat, now: float | None = None) -> None:
        self.replicas[hb.replica_id] = (time.monotonic() if now is None else now, hb)

    def on_scheduler_stats(self, stats: SchedulerStats, now: float | None = None) -> None:
        self.schedulers[stats.scheduler_id] = (time.monotonic() if now is None else now, stats)

    def on_gateway_stats(self, stats: GatewayStats, now: float | None = None) -> None:
        self.gateways[stats.gateway_id] = (time.monotonic() if now is None else now, stats.http_url)
        for model, layers in stats.layer_seconds.items():
            acc = self._layers.setdefault(model, {})
            for part, seconds in layers.items():
                acc[part] = acc.get(part, 0.0) + seconds
        for model, n in stats.completed.items():
            self._completed[model] = self._completed.get(model, 0) + n

    def on_scaler_decision(self, decision: ScalerDecision) -> None:
        self.scaler[(decision.deployment, decision.revision)] = decision

    def live_replicas(self, deployment: str, now: float | None = None) -> list[Heartbeat]:
        now = time.monotonic() if now is None else now
        return sorted((hb for seen, hb in self.replicas.values()
                       if hb.deployment == deployment and now - seen <= self.stale_after),
                      key=lambda hb: hb.replica_id)

    def queue(self, deployment: str, now: float | None = None) -> tuple[int, float]:
        """(requests queued across schedulers, longest wait)."""
        now = time.monotonic() if now is None else now
        depth, wait = 0, 0.0
        for seen, stats in self.schedulers.values():
            if now - seen <= self.stale_after:
                depth += stats.queue_depth.get(deployment, 0)
                wait = max(wait, stats.oldest_wait_s.get(deployment, 0.0))
        return depth, wait

    def deployments(self, now: float | None = None, unmanaged_only: bool = False) -> set[str]:
        """Deployments with live replicas (only those outside control, revision 0, if asked)."""
        now = time.monotonic() if now is None else now
        return {hb.deployment for seen, hb in self.replicas.values()
                if now - seen <= self.stale_after and not (unmanaged_only and hb.revision)}

    def forget(self, deployment: str) -> None:
        """A deleted deployment: its history goes; its draining replicas age out as usual."""
        self.history.pop(deployment, None)
        self._layers.pop(deployment, None)
        self._completed.pop(deployment, None)

    def sample(self, now: float | None = None, wall: float | None = None) -> None:
        """Record one point of every deployment's history (call every couple of seconds)."""
        now = time.monotonic() if now is None else now
        interval = max(now - self._last_sample_at, 1e-3) if self._last_sample_at is not None else None
        self._last_sample_at = now
        for rid in [rid for rid, (seen, _) in self.replicas.items() if now - seen > 60.0]:
            del self.replicas[rid]  # long gone
            self._last_counts.pop(rid, None)
        # Deployments with live replicas, and those with a history (scaled to zero: zeros).
        for name in self.deployments(now) | set(self.history):
            live = self.live_replicas(name, now)
            finished = failed = 0
            by_revision: dict[int, dict[str, float]] = {}
            for hb in live:
                before = self._last_counts.get(hb.replica_id, (hb.requests_finished, hb.requests_failed))
                self._last_counts[hb.replica_id] = (hb.requests_finished, hb.requests_failed)
                done, bad = max(hb.requests_finished - before[0], 0), max(hb.requests_failed - before[1], 0)
                finished, failed = finished + done, failed + bad
                rev = by_revision.setdefault(hb.revision, {"finished": 0, "failed": 0, "replicas": 0})
                rev["finished"] += done
                rev["failed"] += bad
                rev["replicas"] += 1
            if interval is None:
                continue  # the first sample only sets the counters' baseline
            ttfts = [hb.ttft_p90_s for hb in live if hb.ttft_p90_s is not None]
            itls = [hb.itl_p50_s for hb in live if hb.itl_p50_s is not None]
            depth, _ = self.queue(name, now)
            self.history.setdefault(name, deque(maxlen=HISTORY_POINTS)).append(Sample(
                at=time.time() if wall is None else wall, request_rate=finished / interval,
                tokens_per_s=sum(hb.tokens_per_s for hb in live), ttft_p90_s=max(ttfts) if ttfts else None,
                itl_p50_s=sum(itls) / len(itls) if itls else None, queue_depth=depth,
                ready=sum(hb.state == "ready" for hb in live), running=sum(hb.running for hb in live),
                error_rate=failed / finished if finished else 0.0, by_revision=by_revision,
                layer_totals=self._layers.pop(name, {}), completed=self._completed.pop(name, 0)))

    def layers(self, deployment: str, points: int = 30) -> dict:
        """Mean seconds per request in each layer and part, over the last `points` samples."""
        recent = list(self.history.get(deployment, ()))[-points:]
        count = sum(s.completed for s in recent)
        totals: dict[str, float] = {}
        for sample in recent:
            for part, seconds in sample.layer_totals.items():
                totals[part] = totals.get(part, 0.0) + seconds
        out = {"requests": count, "e2e_s": totals.get("e2e", 0.0) / count if count else None}
        for layer, parts in LAYERS.items():
            per_part = {p: totals.get(p, 0.0) / count if count else 0.0 for p in parts}
            out[layer] = {"seconds": sum(per_part.values()), "parts": per_part}
        return out

    def status(self, deployment: str, now: float | None = None) -> dict:
        """Replicas with their state and load, the queue, and the latest figures."""
        now = time.monotonic() if now is None else now
        live = self.live_replicas(deployment, now)
        depth, wait = self.queue(deployment, now)
        history = self.history.get(deployment)
        latest = history[-1] if history else None
        return {
            "replicas": [{"replica_id": hb.replica_id, "revision": hb.revision, "state": hb.state,
                          "running": hb.running, "waiting": hb.waiting,
                          "kv_usage": round(hb.kv_blocks_used / max(hb.kv_blocks_total, 1), 3),
                          "tokens_per_s": round(hb.tokens_per_s, 1), "ttft_p90_s": hb.ttft_p90_s,
                          "itl_p50_s": hb.itl_p50_s, "finished": hb.requests_finished,
                          "failed": hb.requests_failed} for hb in live],
            "queue": {"depth": depth, "oldest_wait_s": round(wait, 3)},
            "throughput": {"requests_per_s": round(latest.request_rate, 2) if latest else 0.0,
                           "tokens_per_s": round(sum(hb.tokens_per_s for hb in live), 1)},
            "latency": {"ttft_p90_s": latest.ttft_p90_s if latest else None,
                        "itl_p50_s": latest.itl_p50_s if latest else None},
            "scaler": [{"revision": rev, "desired": d.desired, "ready": d.ready, "starting": d.starting,
                        "reason": d.reason, "panic": d.panic}
                       for (name, rev), d in sorted(self.scaler.items()) if name == deployment],
        }

    def series(self, deployment: str) -> list[dict]:
        return [{"at": s.at, "request_rate": round(s.request_rate, 3), "tokens_per_s": round(s.tokens_per_s, 1),
                 "ttft_p90_s": s.ttft_p90_s, "itl_p50_s": s.itl_p50_s, "queue_depth": s.queue_depth,
                 "ready": s.ready, "running": s.running, "error_rate": round(s.error_rate, 4),
                 "by_revision": s.by_revision}
                for s in self.history.get(deployment, ())]
