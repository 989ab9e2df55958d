"""The placement policy on crafted sequences: pure logic, no I/O, a hand-run clock."""

from dataclasses import dataclass, field

import pytest

from services.scaler.placement import Held, Placer, shares
from shared.deployments import Placement


@dataclass
class P:
    name: str
    capacity: int
    cost_per_hour: float
    cold_start_s: float = 30.0
    region: str = "east"
    labels: dict = field(default_factory=dict)


SPOT, ONDEMAND, OTHER = P("spot", 3, 1.0), P("ondemand", 10, 2.0), P("other", 10, 3.0, 60.0, "west")
POOLS = [OTHER, ONDEMAND, SPOT]  # given in any order


class Fleet:
    """What the pools hold, moved by plans: a tick starts or cancels replicas to the targets,
    drains the excess, and readies the replicas that were starting at the previous tick."""

    def __init__(self, **ready: int):
        self.held = {p: Held(ready=n) for p, n in ready.items()}

    def act(self, targets: dict[str, int]) -> None:
        for p, target in targets.items():
            h = self.held.setdefault(p, Held())
            if target > h.active:
                h.starting += target - h.active
            else:
                cancel = min(h.starting, h.active - target)
                h.starting -= cancel
                h.ready -= h.active - target

    def tick(self) -> None:
        for h in self.held.values():
            h.ready, h.starting = h.ready + h.starting, 0

    @property
    def ready(self) -> int:
        return sum(h.ready for h in self.held.values())

    def counts(self) -> dict[str, int]:
        return {p: h.active for p, h in self.held.items() if h.active}


def place(placer, wanted, fleet, prefs=None, now=0.0, others=None, pools=POOLS):
    return placer.place(wanted, pools, fleet.held, others or {}, prefs or Placement(), now)


def test_cheapest_pool_with_capacity_first_and_the_rest_is_short():
    plan = place(Placer(), 5, Fleet())
    assert plan.order == ["spot", "ondemand", "other"]
    assert plan.targets == {"spot": 3, "ondemand": 2, "other": 0}
    assert plan.short == 0 and plan.describe() == "spot 3 (full), ondemand 2"
    assert plan.next_cold_start_s == 30.0  # the next replica would go to ondemand
    plan = place(Placer(), 30, Fleet())
    assert plan.targets == {"spot": 3, "ondemand": 10, "other": 10} and plan.short == 7
    assert plan.next_cold_start_s is None and plan.describe().endswith("; short 7")


def test_other_deployments_and_draining_replicas_take_room():
    fleet = Fleet()
    fleet.held["spot"] = Held(draining=1)
    plan = place(Placer(), 5, fleet, others={"spot": 1, "ondemand": 8})
    assert plan.targets == {"spot": 1, "ondemand": 2, "other": 2}


def test_a_refusal_spills_at_once_and_backs_the_pool_off_doubling():
    placer, fleet = Placer(backoff_s=30, max_backoff_s=100), Fleet()
    plan = place(placer, 5, fleet)
    assert plan.targets["spot"] == 3
    # spot refuses while holding 1: placing again sends the other two to ondemand at once.
    assert placer.refused("spot", now=0.0, held=1, reason="quota exhausted") == 30
    plan = place(placer, 5, fleet)
    assert plan.targets == {"spot": 1, "ondemand": 4, "other": 0}
    assert placer.capacity(SPOT, 29.9) == 1 and placer.backoff_left("spot", 10.0) == 20.0
    # After the back-off: the whole capacity again (a probe); it refuses again: twice as long.
    assert place(placer, 5, fleet, now=30.0).ideal["spot"] == 3
    assert placer.refused("spot", now=30.0, held=1, reason="quota exhausted") == 60
    assert placer.refused("spot", now=90.0, held=1, reason="quota exhausted") == 100  # capped
    assert placer.refusals("spot") == 3 and placer.last_refusal("spot") == "quota exhausted"
    # Holding more than when it refused, once the back-off is over: healthy, the count starts over.
    placer.observe("spot", ready=1, now=190.0)
    assert placer.backoffs["spot"].refusals == 3
    placer.observe("spot", ready=2, now=190.0)
    assert placer.refused("spot", now=200.0, held=2, reason="pending") == 30


def test_moving_back_is_make_before_break_and_never_below_wanted():
    placer = Placer(backoff_s=30)
    fleet = Fleet(ondemand=5)  # spot refused earlier: everything went to ondemand
    placer.refused("spot", now=0.0, held=0, reason="quota exhausted")
    assert place(placer, 5, fleet, now=10.0).targets == {"spot": 0, "ondemand": 5, "other": 0}
    # The back-off ends and spot has room: its three start, ondemand's stay until they are ready.
    plan = place(placer, 5, fleet, now=31.0)
    assert plan.ideal == {"spot": 3, "ondemand": 2, "other": 0}
    assert plan.targets == {"spot": 3, "ondemand": 5, "other": 0} and plan.kept == {"ondemand": 3}
    assert plan.describe() == "spot 3 (full), ondemand 5 (3 until replaced)"
    assert plan.steps(fleet.held) == [("spot", 3), ("ondemand", 5), ("other", 0)]
    fleet.act(plan.targets)
    assert fleet.ready == 5
    fleet.tick()  # spot's three are ready: now ondemand gives three up
    plan = place(placer, 5, fleet, now=32.0)
    assert plan.targets == {"spot": 3, "ondemand": 2, "other": 0} and plan.kept == {}
    fleet.act(plan.targets)
    assert fleet.ready == 5 and fleet.counts() == {"spot": 3, "ondemand": 2}


def test_partial_readiness_releases_one_for_one():
    fleet = Fleet(ondemand=5)
    fleet.held["spot"] = Held(ready=1, starting=2)
    plan = place(Placer(), 5, fleet)
    assert plan.kept == {"ondemand": 2} and plan.targets["ondemand"] == 4  # one replaced, one drains
    fleet.act(plan.targets)
    assert fleet.ready == 5


def test_scaling_down_drains_the_least_preferred_first_and_cancels_starting_first():
    fleet = Fleet(spot=3, ondemand=4, other=2)
    plan = place(Placer(), 4, fleet)
    assert plan.targets == {"spot": 3, "ondemand": 1, "other": 0} and plan.kept == {}
    # Starting replicas beyond the ideal serve nobody: cancelled at once, not kept.
    fleet = Fleet(spot=3)
    fleet.held["other"] = Held(starting=2)
    assert place(Placer(), 3, fleet).targets == {"spot": 3, "ondemand": 0, "other": 0}


def test_minimum_spread_puts_one_in_the_next_pools():
    prefs = Placement(min_pools=2)
    assert place(Placer(), 3, Fleet(), prefs).targets == {"spot": 2, "ondemand": 1, "other": 0}
    assert place(Placer(), 1, Fleet(), prefs).targets == {"spot": 1, "ondemand": 0, "other": 0}  # one replica: one pool
    prefs = Placement(min_pools=3)
    assert place(Placer(), 12, Fleet(), prefs).targets == {"spot": 3, "ondemand": 8, "other": 1}
    # A spread pool that is full does not count: the next one with room does.
    full = P("ondemand", 0, 2.0)
    assert place(Placer(), 3, Fleet(), prefs, pools=[SPOT, full, OTHER]).targets == {
        "spot": 2, "ondemand": 0, "other": 1}


def test_preferences_nearest_pinned_allowed_pools_and_labels():
    nearest = Placement(prefer="nearest", region="west")
    plan = place(Placer(), 12, Fleet(), nearest)
    assert plan.order == ["other", "spot", "ondemand"] and plan.targets == {"other": 10, "spot": 2, "ondemand": 0}
    pinned = Placement(prefer="pinned", shares={"ondemand": 50, "other": 50})
    assert place(Placer(), 4, Fleet(), pinned).targets == {"spot": 0, "ondemand": 2, "other": 2}
    # A pinned pool that cannot take its share: the rest goes by cost.
    pinned = Placement(prefer="pinned", shares={"spot": 80, "other": 20})
    assert place(Placer(), 10, Fleet(), pinned).targets == {"spot": 3, "ondemand": 5, "other": 2}
    only = Placement(pools=["other", "ondemand"])
    assert place(Placer(), 3, Fleet(), only).targets == {"ondemand": 3, "other": 0}
    h100 = P("h100-pool", 5, 9.0, labels={"accelerator": "h100"})
    labelled = Placement(labels={"accelerator": "h100"})
    plan = place(Placer(), 7, Fleet(), labelled, pools=[SPOT, h100])
    assert plan.targets == {"h100-pool": 5} and plan.short == 2


def test_replicas_in_a_pool_no_longer_allowed_move_make_before_break():
    fleet = Fleet(spot=2)
    plan = place(Placer(), 2, fleet, Placement(pools=["ondemand"]))
    assert plan.targets == {"ondemand": 2, "spot": 2} and plan.kept == {"spot": 2}
    fleet.act(plan.targets)
    fleet.tick()
    assert place(Placer(), 2, fleet, Placement(pools=["ondemand"])).targets == {"ondemand": 2, "spot": 0}


def test_shares_split_by_largest_remainder():
    assert shares(10, {"a": 50, "b": 50}) == {"a": 5, "b": 5}
    assert shares(3, {"a": 50, "b": 50}) == {"a": 2, "b": 1}
    assert shares(7, {"a": 70, "b": 20, "c": 10}) == {"a": 5, "b": 1, "c": 1}
    assert shares(0, {"a": 100}) == {"a": 0}
    with pytest.raises(ValueError):
        Placer(backoff_s=0)
