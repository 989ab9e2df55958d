"""The gateway's per-request state (services.gateway.flow) and the limits its replicas advertise
(services.gateway.limits): pure logic, no I/O."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.flow import Flow, FlowTable
from services.gateway.limits import AdvertisedLimits, ModelLimits
from shared.protocol import GenerateRequest, Heartbeat


def flow(rid: str = "r1") -> Flow:
    return Flow(GenerateRequest(request_id=rid, model="m", reply_to=f"_INBOX.gw.{rid}", prompt_token_ids=[1, 2],
                                tenant="t"), asyncio.Queue())


async def test_a_flow_is_registered_once_and_closed_once():
    table, f = FlowTable(), flow()
    table.open(f)
    assert table.get("r1") is f and table.of_leg("r1") is f and f.leg_id == "r1" and f.tenant == "t"
    with pytest.raises(ValueError):
        table.open(flow())
    f.timer = asyncio.get_running_loop().call_later(60, lambda: None)
    assert table.close(f) == "r1"  # the leg to cancel
    assert f.closed and f.timer.cancelled() and table.get("r1") is None and table.of_leg("r1") is None
    assert table.close(f) == "" and len(table) == 0  # the second close does nothing


def test_every_leg_of_a_flow_finds_it_until_it_closes():
    table, f = FlowTable(), flow()
    table.open(f)
    f.held_by, f.at_engine, f.replica, f.expected_seq = "scheduler-0", True, "engine-0", 7
    table.start_leg(f, "r1-m1")
    assert (f.leg_id, f.held_by, f.at_engine, f.replica, f.expected_seq) == ("r1-m1", None, False, None, 0)
    assert table.of_leg("r1") is f and table.of_leg("r1-m1") is f  # an earlier leg's late chunk is its to drop
    f.leg_id = ""  # between legs (a migration in flight)
    assert table.close(f) == ""
    assert table.of_leg("r1-m1") is None
    table.start_leg(f, "r1-m2")  # a leg submitted after the close is not registered
    assert table.of_leg("r1-m2") is None


def beat(replica: str, model: str = "m", **limits) -> Heartbeat:
    return Heartbeat(replica_id=replica, model=model, deployment=model, state="ready", **limits)


def test_the_tightest_advertised_limit_counts_and_config_json_when_none_said():
    config = ModelLimits(2048, 4096)
    limits = AdvertisedLimits(fresh_s=10)
    assert limits.of("m", config, 0) == config
    limits.note(beat("a", max_model_len=1024, vocab_size=4000), 0)
    limits.note(beat("b", max_model_len=512), 1)  # says only max_model_len
    limits.note(beat("c", model="other", max_model_len=64, vocab_size=10), 1)
    assert limits.of("m", config, 2) == ModelLimits(512, 4000)
    assert limits.of("other", config, 2) == ModelLimits(64, 10)
    limits.note(beat("b"), 3)  # b no longer says (an older engine took its place)
    assert limits.of("m", config, 3) == ModelLimits(1024, 4000)
    assert limits.of("m", config, 10.5) == config  # a fell silent: gone
