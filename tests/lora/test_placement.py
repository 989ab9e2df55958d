"""The adapter placement policy, the router's adapter term and the scaler's adapter floor."""

from services.scaler.service import lora_floor
from services.scheduler.lora_placement import DemandWindow, adapter_replica_floor, place_adapters, placed_replicas
from services.scheduler.policy import ReplicaState, Router
from shared.protocol import Heartbeat


def test_hot_adapters_get_replicas_in_proportion_and_slots_are_respected():
    demand = {"hot": 60.0, "warm": 20.0, **{f"cold{i}": 1.0 for i in range(20)}}
    slots = {f"r{i}": 2 for i in range(4)}
    placement = place_adapters(demand, slots)
    assert all(len(a) <= 2 for a in placement.values())
    where = placed_replicas(placement)
    assert len(where["hot"]) == 4  # 60 of 100 requests on 4 replicas: ceil(1.5 * 2.4), every replica
    assert len(where["warm"]) == 2  # ceil(1.5 * 0.8)
    assert sum(len(a) for a in placement.values()) == 8  # every slot used, the rest of the cold tail unplaced


def test_placement_keeps_what_is_resident():
    demand = {"a": 5.0, "b": 5.0}
    slots = {"r0": 1, "r1": 1}
    assert place_adapters(demand, slots, {"r0": {"b"}, "r1": {"a"}}, headroom=1.0) == {"r0": {"b"}, "r1": {"a"}}
    assert place_adapters({}, slots) == {"r0": set(), "r1": set()}


def test_demand_window_decays():
    w = DemandWindow(half_life_s=10)
    w.add("a", 0.0, 8)
    assert abs(w.demand(10.0)["a"] - 4) < 1e-9


def test_router_prefers_resident_then_cached_then_placed():
    router = Router(seed=0)
    resident = ReplicaState("res", lora_resident=frozenset({"a"}), max_loras=2)
    cached = ReplicaState("cache", lora_cached=frozenset({"a"}), max_loras=2)
    cold = ReplicaState("cold", max_loras=2)
    order = [d.replica.replica_id for d in router.rank("kv_aware", [cold, cached, resident], adapter="a")]
    assert order == ["res", "cache", "cold"]
    order = [d.replica.replica_id for d in router.rank("kv_aware", [cold, cached, resident], adapter="a",
                                                          placed={"cold"})]
    assert order == ["cold", "res", "cache"]  # off its placement costs more than a load
    # Load still counts: a resident replica with 3 more requests than a cold, placed one loses.
    busy = ReplicaState("busy", running=3, lora_resident=frozenset({"a"}), max_loras=2)
    assert router.rank("kv_aware", [busy, cold], adapter="a", placed={"cold"})[0].replica.replica_id == "cold"
    assert Router.adapter_cost(cold, None) == 0.0


def test_scaler_floor_counts_adapters_in_use():
    assert adapter_replica_floor(set(), 4) == 0 and adapter_replica_floor({"a", "b", "c", "d", "e"}, 4) == 2
    hb = lambda rid, running, waiting: Heartbeat(replica_id=rid, model="m", deployment="m", state="ready",  # noqa: E731
                                                 lora_running=running, lora_waiting=waiting, max_loras=2)
    assert lora_floor([hb("r0", ["a", "b"], ["c"]), hb("r1", ["d"], ["a"])]) == 2
    assert lora_floor([Heartbeat(replica_id="r", model="m", deployment="m", state="ready")]) == 0
