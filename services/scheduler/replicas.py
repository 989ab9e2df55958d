"""The scheduler's live view of engine replicas: heartbeats for load, the registry for leases."""

from __future__ import annotations

import time

from services.scheduler.policy import ReplicaState
from shared.protocol import Heartbeat


class ReplicaView:
    RATE_WINDOW_S = 2.0  # finish rates are measured over reports at least this far apart

    def __init__(self, stale_after: float = 5.0, avoid_for: float = 5.0):
        self.stale_after = stale_after
        self.avoid_for = avoid_for
        self.replicas: dict[str, dict[str, ReplicaState]] = {}  # model -> replica id -> state
        self._avoid_until: dict[str, float] = {}
        self._finished: dict[str, tuple[float, int]] = {}  # replica id -> (report time, requests ended) baseline

    def on_heartbeat(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        per_model = self.replicas.setdefault(hb.model, {})
        r = per_model.get(hb.replica_id) or ReplicaState(hb.replica_id)
        r.state, r.running, r.waiting = hb.state, hb.running, hb.waiting
        r.kv_blocks_used, r.kv_blocks_total = hb.kv_blocks_used, hb.kv_blocks_total
        r.block_size, r.max_num_seqs, r.revision = hb.block_size, hb.max_num_seqs, hb.revision
        r.region, r.max_model_len, r.vocab_size = hb.region, hb.max_model_len, hb.vocab_size
        r.lora_resident, r.lora_cached, r.max_loras = frozenset(hb.lora_resident), frozenset(hb.lora_cached), hb.max_loras
        r.reported(hb.accepted_total)
        r.ttft_s = hb.ttft_p90_s
        r.last_seen = now
        per_model[hb.replica_id] = r
        self._note_finished(r, hb.timestamp, hb.requests_finished + hb.requests_failed)

    def _note_finished(self, r: ReplicaState, at: float, ended: int) -> None:
        """The replica's finish rate (requests ended per second, smoothed), from its cumulative count."""
        before = self._finished.get(r.replica_id)
        if before is None or ended < before[1] or at < before[0]:  # first report, or the engine restarted
            self._finished[r.replica_id] = (at, ended)
            return
        if at - before[0] >= self.RATE_WINDOW_S:
            rate = (ended - before[1]) / (at - before[0])
            r.finish_rate = rate if r.finish_rate == 0 else 0.5 * r.finish_rate + 0.5 * rate
            self._finished[r.replica_id] = (at, ended)

    def sync_registry(self, model: str, live: dict[str, dict[str, str]], now: float | None = None) -> None:
        """Align with the registry: forget replicas whose lease is gone (killed, partitioned,
        deregistered); learn live ones not heard from yet (this scheduler just started)."""
        now = time.monotonic() if now is None else now
        per_model = self.replicas.setdefault(model, {})
        for rid in list(per_model):
            if rid not in live:
                del per_model[rid]
        for rid, fields in live.items():
            if rid not in per_model:
                per_model[rid] = ReplicaState(
                    rid, state=fields.get("state", "starting"), running=int(fields.get("running", 0)),
                    waiting=int(fields.get("waiting", 0)), kv_blocks_used=int(fields.get("kv_blocks_used", 0)),
                    kv_blocks_total=int(fields.get("kv_blocks_total", 1)),
                    block_size=int(fields.get("block_size", 16)), max_num_seqs=int(fields.get("max_num_seqs", 64)),
                    revision=int(fields.get("revision", 0)), region=fields.get("region", ""),
                    max_model_len=int(fields.get("max_model_len", 0)), vocab_size=int(fields.get("vocab_size", 0)),
                    last_seen=now)

    def avoid(self, replica_id: str, now: float | None = None) -> None:
        """Keep a replica that just failed out of routing for a while."""
        self._avoid_until[replica_id] = (time.monotonic() if now is None else now) + self.avoid_for

    def candidates(self, model: str, now: float | None = None) -> list[ReplicaState]:
        now = time.monotonic() if now is None else now
        return [r for r in self.replicas.get(model, {}).values()
                if r.state == "ready" and now - r.last_seen <= self.stale_after
                and self._avoid_until.get(r.replica_id, 0.0) <= now]

    def time_to_first_token(self, model: str) -> float:
        """How long a request routed now takes to its first token, from what the model's replicas
        report (their recent p90, the median of them; 0 while unknown)."""
        ttfts = sorted(r.ttft_s for r in self.replicas.get(model, {}).values() if r.ttft_s is not None)
        return ttfts[len(ttfts) // 2] if ttfts else 0.0

    def models(self) -> list[str]:
        return [m for m, reps in self.replicas.items() if reps]
