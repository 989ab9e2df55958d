"""The local actuator as a capacity pool: it runs at most its capacity of engines (draining ones
count: they still hold the machine), starts what fits when asked for more and refuses the rest,
and placement then sends the rest to the next pool at once. The engines here are fake engine
processes (a shell that sleeps until SIGTERM): the limit is about processes, not models; the
local stack test (test_pools_e2e.py) runs real engines in local pools."""

import time

import pytest

from services.control.spec import validate
from services.scaler.actuators import LocalProcessActuator, PoolRefused, pool_actuator
from services.scaler.placement import Placer
from services.scaler.pools import PoolSet
from shared.deployments import Placement
from shared.pools import parse_pool


def wait_gone(actuator, alive, timeout=10.0):
    deadline = time.monotonic() + timeout
    while actuator.alive() > alive:
        assert time.monotonic() < deadline
        time.sleep(0.05)


async def test_a_local_pool_at_its_limit_starts_what_fits_and_refuses(fake_engine_processes, tmp_path, tiny_model_dir):
    spec = validate({"name": "llm", "model": str(tiny_model_dir)})
    actuator = LocalProcessActuator("nats://x", "redis://x", tmp_path, capacity=2, pool="here", region="lab")
    try:
        with pytest.raises(PoolRefused, match="local pool at its limit of 2 engines") as refused:
            await actuator.scale("llm", 1, spec, 3, {})
        assert refused.value.held == 2 and actuator.alive() == 2
        assert actuator.held("llm", 1).starting == 2
        (replica,) = [r for r in actuator.replicas("llm", 1)][:1]
        assert "--pool here --region lab" in " ".join(replica.proc.args)
        actuator.note_ready(replica.replica_id)
        await actuator.scale("llm", 1, spec, 1, {})  # scaling down is never refused
        held = actuator.held("llm", 1)
        # The one not ready yet is stopped first (it may already have exited: draining 1 or 0).
        assert (held.ready, held.starting) == (1, 0) and held.draining <= 1
        wait_gone(actuator, 1)
        assert actuator.held("llm", 1).draining == 0
        actuator.set_capacity(1)
        with pytest.raises(PoolRefused):
            await actuator.scale("other", 1, spec, 1, {})  # full: another deployment gets nothing
        assert actuator.take_cold_starts() and actuator.take_cold_starts() == []
    finally:
        await actuator.close()
    assert actuator.alive() == 0


async def test_placement_spills_past_a_local_pool_at_its_limit(fake_engine_processes, tmp_path, tiny_model_dir):
    spec = validate({"name": "llm", "model": str(tiny_model_dir)})
    pools = PoolSet(LocalProcessActuator("", "", tmp_path), lambda s: pool_actuator(s, "", "", tmp_path),
                    placer=Placer(backoff_s=60))
    await pools.sync({"small": parse_pool({"name": "small", "capacity": 3, "cost_per_hour": 1}),
                      "big": parse_pool({"name": "big", "capacity": 5, "cost_per_hour": 2})})
    pools.pools["small"].actuator.set_capacity(1)  # the machine runs fewer than its spec says
    try:
        plan = await pools.place("llm", 1, spec, 3, Placement(), {}, time.monotonic())
        assert plan.targets == {"small": 1, "big": 2}  # the refusal and the spill in one call
        assert pools.pools["small"].actuator.alive() == 1 and pools.pools["big"].actuator.alive() == 2
        assert pools.placer.refusals("small") == 1
        assert pools.placer.last_refusal("small") == "local pool at its limit of 1 engines"
    finally:
        await pools.close()
