"""Routing across regions: pure logic on crafted replicas, the finish rate the scheduler measures
from heartbeats, and a real scheduler with engines in two regions."""

import asyncio
import math
import signal
import subprocess
import sys

import aiohttp
import pytest

from services.scheduler.policy import ReplicaState, Router
from services.scheduler.regions import queueing_s, rank_across_regions
from services.scheduler.replicas import ReplicaView
from shared import protocol, registry
from shared.bus import Bus
from shared.localstack import LocalInfra
from shared.protocol import Heartbeat
from shared.store import connect_redis
from tests.helpers import new_request, start_worker, stream_request, wait_registered

PENALTY = 0.05


def replica(rid, region, running=0, max_num_seqs=4, rate=0.0, **kw):
    return ReplicaState(rid, region=region, running=running, max_num_seqs=max_num_seqs, finish_rate=rate, **kw)


def choose(candidates, region="east", penalty=PENALTY, policy="least_load", **kw):
    return rank_across_regions(Router(seed=1), policy, candidates, region, penalty, **kw)


def test_queueing_is_the_requests_beyond_a_full_batch_at_the_finish_rate():
    assert queueing_s(replica("a", "east", running=2)) == 0.0  # room in the batch
    assert queueing_s(replica("a", "east", running=4, rate=10.0)) == pytest.approx(0.1)  # one ahead of it
    assert queueing_s(replica("a", "east", running=4, waiting=1, rate=10.0)) == pytest.approx(0.2)
    assert queueing_s(replica("a", "east", running=4)) == 0.0  # full, no rate measured yet: no estimate
    assert math.isinf(queueing_s(replica("a", "east", running=5)))  # saturated: it would only wait there


def test_stays_in_its_region_while_a_replica_there_has_room():
    east, west = replica("e", "east", running=3), replica("w", "west", running=0)
    choice = choose([east, west])
    assert choice.ranked[0].replica is east and not choice.crossed
    assert [d.replica for d in choice.ranked] == [east, west]  # retries may still cross


def test_crosses_when_the_queueing_avoided_exceeds_the_penalty():
    east, west = replica("e", "east", running=4, rate=10.0), replica("w", "west", running=1)
    choice = choose([east, west])  # 100 ms of queueing in east against a 50 ms penalty
    assert choice.ranked[0].replica is west and choice.crossed
    assert choice.avoided_s == pytest.approx(0.1) and "100 ms > penalty 50 ms" in choice.reason
    assert not choose([east, west], penalty=0.2).crossed  # a dearer crossing: it waits at home
    fast = replica("e", "east", running=4, rate=40.0)  # 25 ms: not worth 50 ms
    assert choose([fast, west]).ranked[0].replica is fast
    busy_far = replica("w", "west", running=4, rate=40.0)  # the far one queues too: 100 - 25 ms
    assert choose([east, busy_far]).crossed


def test_no_replica_in_the_region_or_no_regions_at_all():
    west = replica("w", "west")
    assert choose([west]).crossed and choose([west]).reason == "no replica in region east"
    unmanaged = [ReplicaState("a", running=3), ReplicaState("b")]  # no regions: the policy alone
    assert choose(unmanaged, region="").ranked[0].replica.replica_id == "b"
    assert not choose([replica("x", "")], region="east").crossed  # a replica without a region is near


def test_saturated_far_replicas_are_never_worth_crossing_to():
    east = replica("e", "east", running=4, rate=1.0)
    west = replica("w", "west", running=5, max_num_seqs=4)  # saturated
    choice = choose([east, west])
    assert choice.ranked[0].replica is east and not choice.crossed


def test_prefix_overlap_still_counts_inside_a_region():
    holder, other, far = replica("e1", "east", running=1), replica("e2", "east"), replica("w", "west")
    choice = choose([holder, other, far], policy="kv_aware", prompt_blocks=20, overlaps={"e1": 20, "w": 20})
    assert choice.ranked[0].replica is holder and not choice.crossed


def test_the_finish_rate_comes_from_heartbeats():
    view = ReplicaView()

    def beat(at, finished, failed=0):
        view.on_heartbeat(Heartbeat(replica_id="e", model="m", deployment="m", state="ready", region="east",
                                    requests_finished=finished, requests_failed=failed, timestamp=at), now=at)
        return view.replicas["m"]["e"]

    assert beat(100.0, 0).finish_rate == 0.0
    assert beat(101.0, 10).finish_rate == 0.0  # under the 2 s window: not yet
    r = beat(102.0, 18, failed=2)
    assert r.finish_rate == pytest.approx(10.0) and r.region == "east"
    assert beat(104.0, 38, failed=2).finish_rate == pytest.approx(10.0)  # 0.5 * 10 + 0.5 * 10
    assert beat(106.0, 38, failed=2).finish_rate == pytest.approx(5.0)  # nothing finished: halves
    assert beat(107.0, 1).finish_rate == pytest.approx(5.0)  # restarted engine: a new baseline


@pytest.mark.slow
async def test_a_scheduler_keeps_requests_in_their_region_until_queueing_there_is_worth_crossing(
        tiny_model_dir, tmp_path):
    """Real engines: one in east, one in west, each two sequences at a time and slowed down.
    Requests from east go to east while it has room; a burst queues there and some cross to
    west. Its own NATS and Valkey: schedulers on one NATS share the requests."""
    engine = ["--max-num-seqs", "2", "--debug-step-delay", "0.05", "--threads", "1"]
    with LocalInfra() as infra:
        workers = [start_worker(infra, tiny_model_dir, tmp_path, rid, "--region", region, *engine,
                                deployment="regional") for rid, region in (("east-0", "east"), ("west-0", "west"))]
        with open(tmp_path / "scheduler.log", "wb") as log:
            scheduler = subprocess.Popen(
                [sys.executable, "-m", "services.scheduler", "--scheduler-id", "scheduler-regions", "--region", "east",
                 "--policy", "least_load", "--nats-url", infra.nats_url, "--redis-url", infra.redis_url,
                 "--log-format", "json"], stdout=log, stderr=subprocess.STDOUT)
        bus = await Bus.connect(infra.nats_url, "test-regions")
        redis = connect_redis(infra.redis_url)
        try:
            for w in workers:
                await wait_registered(redis, w)
            await asyncio.sleep(1.5)  # the scheduler has heard both engines

            def request(region):
                req = new_request([5, 6, 7, 8], max_tokens=12, ignore_eos=True, temperature=0.0)
                req.model, req.region = "regional", region
                return req

            for region in ("east", "west"):  # one at a time: each stays home (and both measure a finish rate)
                for _ in range(5):
                    final = (await stream_request(bus, protocol.GENERATE, request(region)))[-1]
                    assert final.finish_reason == "length" and final.replica_id == f"{region}-0", final
            await asyncio.sleep(2.5)  # a heartbeat window further: the finish rates are known
            finals = [c[-1] for c in await asyncio.gather(*(stream_request(bus, protocol.GENERATE, request("east"))
                                                            for _ in range(8)))]
            assert all(f.finish_reason == "length" for f in finals)
            served = [f.replica_id for f in finals]
            assert served.count("east-0") >= 1 and served.count("west-0") >= 1, served
            url = (await registry.services(redis, "scheduler"))["scheduler-regions"]["http_url"]
            async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
                crossed = [line for line in (await resp.text()).splitlines()
                           if line.startswith("strata:scheduler_cross_region_total")]
            assert len(crossed) == 1 and 'from_region="east"' in crossed[0] and 'to_region="west"' in crossed[0]
            assert float(crossed[0].rsplit(" ", 1)[1]) == served.count("west-0")
        finally:
            await bus.close()
            await redis.aclose()
            scheduler.send_signal(signal.SIGTERM)
            scheduler.wait(30)
            for w in workers:
                w.terminate()
