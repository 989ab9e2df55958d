"""Routing across regions: pure logic, no I/O (like services.scheduler.policy).

A request carries its region (the gateway's, or the caller's); replicas report theirs. The
deployment's routing policy ranks the replicas in the request's region and, apart, those
elsewhere, so prefix-cache overlap and load weigh inside each group as they always do. The
request crosses to the best replica elsewhere only when the queueing that avoids is worth more
than the inter-region penalty (the round trip it adds, 50 ms by default): with room in a near
replica there is nothing to avoid, so it stays.

Queueing on a replica is estimated from what it reports: the requests it holds beyond a full
batch, this one included, wait for slots that free at the rate it finishes requests. Without a
measured rate there is no estimate: only a saturated replica (the scheduler's own rule: more
work would only wait there) counts as a wait worth leaving for.

A request or replica without a region is near everything: fleets without regions route as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.policy import Decision, ReplicaState, Router

DEFAULT_PENALTY_S = 0.05


def queueing_s(r: ReplicaState) -> float:
    """Expected wait before a request sent now starts on r."""
    over = r.load + 1 - r.max_num_seqs
    if over <= 0:
        return 0.0
    if r.finish_rate > 0:
        return over / r.finish_rate
    return math.inf if r.saturated else 0.0


def near(r: ReplicaState, region: str) -> bool:
    return not region or not r.region or r.region == region


@dataclass
class RegionChoice:
    ranked: list[Decision]  # best first: the chosen region's replicas, then the others'
    crossed: bool = False  # the request leaves its region
    avoided_s: float = 0.0  # queueing avoided by crossing (estimate)
    reason: str = ""


def rank_across_regions(router: Router, policy: str, candidates: list[ReplicaState], region: str, penalty_s: float,
                        prompt_blocks: int = 0, overlaps: dict[str, int] | None = None, adapter: str | None = None,
                        placed: set[str] | None = None) -> RegionChoice:
    def rank(replicas: list[ReplicaState]) -> list[Decision]:
        return router.rank(policy, replicas, prompt_blocks, overlaps, adapter, placed)

    local = [r for r in candidates if near(r, region)]
    remote = [r for r in candidates if not near(r, region)]
    if not remote:
        return RegionChoice(rank(candidates))
    near_ranked = rank(local)
    far_ranked = rank([r for r in remote if not r.saturated])
    far_all = far_ranked + [d for d in rank(remote) if d.replica.saturated]
    if not near_ranked:
        return RegionChoice(far_all, crossed=True, reason=f"no replica in region {region}")
    if not far_ranked:
        return RegionChoice(near_ranked + far_all)
    wait_near, wait_far = queueing_s(near_ranked[0].replica), queueing_s(far_ranked[0].replica)
    avoided = wait_near - wait_far
    if avoided > penalty_s:
        shown = "no slot soon" if math.isinf(wait_near) else f"{wait_near * 1e3:.0f} ms"
        return RegionChoice(far_ranked + near_ranked + far_all[len(far_ranked):], crossed=True, avoided_s=avoided,
                            reason=f"queueing in {region}: {shown} > penalty {penalty_s * 1e3:.0f} ms")
    return RegionChoice(near_ranked + far_all)
