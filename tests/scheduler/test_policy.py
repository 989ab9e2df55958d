"""Routing policies and prefix overlap: pure logic, no I/O."""

import random
from collections import Counter

import pytest

from services.scheduler.policy import ReplicaState, Router, prefix_overlaps


def replicas(n=3, **kw):
    return [ReplicaState(f"r{i}", **kw) for i in range(n)]


def test_prefix_overlap_counts_only_consecutive_leading_blocks():
    holders = [{"a", "b"}, {"a", "b"}, {"b", "c"}, {"a", "b", "c"}]
    assert prefix_overlaps(holders, ["a", "b", "c", "d"]) == {"a": 2, "b": 4, "c": 0, "d": 0}
    assert prefix_overlaps([], ["a"]) == {"a": 0}


def test_kv_aware_picks_the_replica_holding_the_prefix():
    reps = replicas(3)
    decision = Router(seed=1).rank("kv_aware", reps, prompt_blocks=20, overlaps={"r2": 18})[0]
    assert decision.replica.replica_id == "r2" and decision.cached_blocks == 18
    assert decision.scores["r2"] < min(decision.scores["r0"], decision.scores["r1"])


def test_kv_aware_leaves_a_hot_holder_only_when_it_is_much_busier():
    holder, other = ReplicaState("holder", running=4), ReplicaState("other", running=3)
    decision = Router(seed=1).rank("kv_aware", [holder, other], prompt_blocks=20, overlaps={"holder": 20})[0]
    assert decision.replica.replica_id == "holder"  # one more request does not outweigh 20 cached blocks
    holder.running = 10
    decision = Router(seed=1).rank("kv_aware", [holder, other], prompt_blocks=20, overlaps={"holder": 20})[0]
    assert decision.replica.replica_id == "other"  # seven more does: the hot prefix spreads
    # A lighter load weight keeps it on the holder.
    decision = Router(load_weight=1.0, seed=1).rank("kv_aware", [holder, other], 20, {"holder": 20})[0]
    assert decision.replica.replica_id == "holder"


def test_inflight_requests_spread_a_burst_of_new_prefixes():
    reps = replicas(4)
    router = Router(seed=3)
    chosen = []
    for _ in range(8):  # eight requests before any heartbeat: each counts as load at once
        d = router.rank("kv_aware", reps, prompt_blocks=30)[0]
        d.replica.inflight += 1
        chosen.append(d.replica.replica_id)
    assert Counter(chosen) == {"r0": 2, "r1": 2, "r2": 2, "r3": 2}


def test_least_load_and_round_robin():
    reps = replicas(3)
    reps[0].running, reps[1].running, reps[2].running = 5, 1, 3
    assert [d.replica.replica_id for d in Router(seed=0).rank("least_load", reps)] == ["r1", "r2", "r0"]
    router = Router(seed=0)
    picks = [router.rank("round_robin", reps)[0].replica.replica_id for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_ties_are_broken_at_random():
    picks = Counter(Router(seed=s).rank("least_load", replicas(3))[0].replica.replica_id for s in range(60))
    assert set(picks) == {"r0", "r1", "r2"} and min(picks.values()) > 8


def test_saturation_and_unknown_policy():
    r = ReplicaState("x", running=64, waiting=1, max_num_seqs=64)
    assert r.saturated and not ReplicaState("y", running=10).saturated
    assert ReplicaState("z", kv_blocks_used=99, kv_blocks_total=100).saturated
    with pytest.raises(ValueError):
        Router().rank("fastest", replicas(1))


def test_requests_count_as_load_until_a_report_includes_them():
    r = ReplicaState("r", running=2)
    r.reported(10)
    r.acknowledged(11)
    r.acknowledged(12)
    assert r.load == 4
    r.reported(11)  # a report that saw request 11 (in running/waiting) but not 12 yet
    assert r.unreported == [12] and r.load == 3
    r.acknowledged(9)  # acknowledged after a report that already counted it: not twice
    assert r.unreported == [12]


def test_least_loaded_is_the_head_of_the_least_load_ranking_with_the_same_draws():
    """The simulators' fast path picks what rank("least_load") puts first, ties included, and
    leaves the RNG where rank leaves it, so a simulation's routing does not change."""
    rng = random.Random(7)
    fast, full = Router(seed=3), Router(seed=3)
    for _ in range(300):
        reps = [ReplicaState(f"r{i}", running=rng.randint(0, 2), kv_blocks_used=rng.choice([0, 5]),
                             kv_blocks_total=10) for i in range(rng.randint(1, 5))]
        assert fast.least_loaded(reps) is full.rank("least_load", reps)[0].replica
    assert fast.rng.random() == full.rng.random()
