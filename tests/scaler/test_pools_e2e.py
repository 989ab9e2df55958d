"""Capacity pools on a local stack: two local pools (capacity 1 and 2, the second dearer). Under
a load step the second pool takes the overflow; afterwards the fleet goes back to the cheaper
pool; when the cheaper pool loses its capacity the replica moves to the other and, when the
capacity returns, back again, make-before-break: no stream is cut and a replica is always ready."""

import threading
import time
import uuid

import pytest
from openai import OpenAI

from tests.scaler.test_autoscale_e2e import Streams, wait_served, wait_until

pytestmark = pytest.mark.slow


def replicas_by_pool(stack, name: str) -> dict[str, list[str]]:
    """Pool -> states of the deployment's live replicas there (from their heartbeats)."""
    out: dict[str, list[str]] = {}
    for r in stack.client.status(name)["replicas"]:
        out.setdefault(r["pool"], []).append(r["state"])
    return out


def ready_in(stack, name: str, pool: str) -> int:
    return replicas_by_pool(stack, name).get(pool, []).count("ready")


class ReadyWatch:
    """Samples the deployment's ready replicas in the background: the fewest seen."""

    def __init__(self, stack, name: str):
        self.stack, self.name, self.fewest, self.samples = stack, name, None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready = sum(r["state"] == "ready" for r in self.stack.client.status(self.name)["replicas"])
            self.fewest = ready if self.fewest is None else min(self.fewest, ready)
            self.samples += 1
            time.sleep(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.fewest


@pytest.fixture
def pools(managed_stack):
    """Two local pools for this test; deleted after it with its deployment (the stack is shared)."""
    suffix = uuid.uuid4().hex[:4]
    cheap, dear = f"cheap-{suffix}", f"dear-{suffix}"
    managed_stack.apply_pools([
        {"name": cheap, "region": "local", "capacity": 1, "cost_per_hour": 1.0, "cold_start_s": 10},
        {"name": dear, "region": "local", "capacity": 2, "cost_per_hour": 2.0, "cold_start_s": 10}])
    yield cheap, dear
    for d in managed_stack.client.deployments()["deployments"]:
        if d["name"] == "pooled":
            managed_stack.client.delete("pooled")
    for name in (cheap, dear):
        managed_stack.client.delete_pool(name)


def test_overflow_goes_to_the_second_pool_and_moves_back_without_cutting_a_stream(managed_stack, tiny_model_dir,
                                                                                   pools):
    stack, (cheap, dear) = managed_stack, pools
    stack.deploy({"name": "pooled", "model": str(tiny_model_dir), "replicas": {"min": 1, "max": 3},
                  "engine": {"max_num_seqs": 4, "debug_step_delay": 0.02}, "slo": {"ttft_ms": 500},
                  "scaling": {"target_concurrency": 3, "stable_window_s": 6, "panic_window_s": 2,
                              "scale_down_delay_s": 4},
                  "placement": {"pools": [cheap, dear]}})
    wait_until(lambda: ready_in(stack, "pooled", cheap) == 1, 120, "a replica in the cheaper pool")
    assert replicas_by_pool(stack, "pooled") == {cheap: ["ready"]}
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    wait_served(client, "pooled")

    long_streams = Streams(client, "pooled", threads=2, max_tokens=150)  # alive through every move
    watch = None
    try:
        step = Streams(client, "pooled", threads=6, max_tokens=32)  # twice what one replica batches
        try:
            wait_until(lambda: ready_in(stack, "pooled", dear) >= 1, 120, "the overflow in the second pool")
            pools_now = {p["name"]: p["status"] for p in stack.client.pools()["pools"]}
            assert pools_now[cheap]["used"] == 1 and pools_now[cheap]["deployments"] == {"pooled": 1}
            assert pools_now[dear]["deployments"]["pooled"] >= 1
        finally:
            step.stop()
        # The step is over: back to one replica, in the cheaper pool.
        wait_until(lambda: replicas_by_pool(stack, "pooled") == {cheap: ["ready"]}, 120, "back to the cheaper pool")

        watch = ReadyWatch(stack, "pooled")
        stack.client.set_pool(cheap, {"capacity": 0})  # the cheap pool loses its capacity
        wait_until(lambda: replicas_by_pool(stack, "pooled") == {dear: ["ready"]}, 120, "the move to the other pool")
        stack.client.set_pool(cheap, {"capacity": 1})  # it is back: the replica moves back
        wait_until(lambda: replicas_by_pool(stack, "pooled") == {cheap: ["ready"]}, 120, "the move back")
    finally:
        fewest = watch.stop() if watch is not None else None
        long_streams.stop()
    decisions = stack.client.status("pooled")["scaler"]

    assert step.failures == [] and long_streams.failures == [], (step.failures + long_streams.failures)[:5]
    assert step.done and long_streams.done
    assert all(r == (32, "length") for r in step.done), [r for r in step.done if r != (32, "length")][:5]
    assert all(r == (150, "length") for r in long_streams.done), long_streams.done  # no stream was cut
    assert fewest >= 1 and watch.samples > 10  # make-before-break: never without a ready replica
    assert decisions[0]["pools"] == {cheap: 1} and decisions[0]["short"] == 0
    print(f"{len(step.done)} step streams and {len(long_streams.done)} long streams, none cut; "
          f"fewest ready replicas while moving: {fewest} ({watch.samples} samples)")
