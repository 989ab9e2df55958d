"""The scaler on a local stack (local actuator): a load step adds an engine and the queue
drains; when the load stops it scales back to min, draining, so no stream is cut; a deployment
at zero replicas serves its first request once the scaler has started one."""

import concurrent.futures
import threading
import time

import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow


def ready_replicas(stack, name: str) -> int:
    return sum(r["state"] == "ready" for r in stack.client.status(name)["replicas"])


def wait_until(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_served(client: OpenAI, name: str) -> None:
    wait_until(lambda: name in [m.id for m in client.models.list()], 20, f"the gateway to serve {name}")


class Streams:
    """Streaming requests in a loop; records every stream's token count and finish reason."""

    def __init__(self, client: OpenAI, model: str, threads: int, max_tokens: int):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.done: list[tuple[int, str]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                tokens, reason = 0, None
                for event in self.client.completions.create(
                        model=self.model, prompt="Once upon a time", max_tokens=self.max_tokens, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=120):
                    for choice in event.choices:
                        reason = choice.finish_reason or reason
                    if event.usage is not None:
                        tokens = event.usage.completion_tokens
                self.done.append((tokens, reason))
            except Exception as exc:  # recorded: the test asserts there were none
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=180)
        self._pool.shutdown()


@pytest.fixture
def cleanup(managed_stack):
    """The stack is shared: every deployment a test makes is deleted after it (its engines drain)."""
    before = {d["name"] for d in managed_stack.client.deployments()["deployments"]}
    yield
    for d in managed_stack.client.deployments()["deployments"]:
        if d["name"] not in before:
            managed_stack.client.delete(d["name"])


def test_load_step_scales_up_then_back_to_min_without_cutting_streams(managed_stack, tiny_model_dir, cleanup):
    stack = managed_stack
    stack.deploy({"name": "elastic", "model": str(tiny_model_dir), "replicas": {"min": 1, "max": 2},
                  "engine": {"max_num_seqs": 4, "debug_step_delay": 0.02}, "slo": {"ttft_ms": 500},
                  "scaling": {"target_concurrency": 3, "stable_window_s": 6, "panic_window_s": 2,
                              "scale_down_delay_s": 4}})
    stack.wait_replicas("elastic", 1)
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    wait_served(client, "elastic")

    # 8 concurrent streams: twice what one replica batches (max_num_seqs 4), what two fit.
    step = Streams(client, "elastic", threads=6, max_tokens=32)
    long_streams = Streams(client, "elastic", threads=2, max_tokens=150)  # alive through the scale-down
    try:
        wait_until(lambda: stack.client.status("elastic")["queue"]["depth"] > 0, 30, "a queue to form")
        wait_until(lambda: ready_replicas(stack, "elastic") == 2, 90, "the scaler to add an engine")
        scaled_up = stack.client.status("elastic")["scaler"]
        # With two engines the step's load fits, and the queue drains.
        wait_until(lambda: stack.client.status("elastic")["queue"]["depth"] == 0, 60, "the queue to drain")
    finally:
        step.stop()
    wait_until(lambda: ready_replicas(stack, "elastic") == 1, 90, "scale back to min")
    long_streams.stop()

    assert step.failures == [] and long_streams.failures == [], (step.failures + long_streams.failures)[:5]
    assert step.done and long_streams.done
    assert all(r == (32, "length") for r in step.done), [r for r in step.done if r != (32, "length")][:5]
    assert all(r == (150, "length") for r in long_streams.done), long_streams.done
    assert any(d["desired"] == 2 for d in scaled_up), scaled_up


def test_first_request_at_zero_replicas_waits_for_one_to_start(managed_stack, tiny_model_dir, cleanup):
    stack = managed_stack
    stack.deploy({"name": "cold", "model": str(tiny_model_dir), "replicas": {"min": 0, "max": 1},
                  "scaling": {"scale_to_zero_after_s": 3, "stable_window_s": 4, "panic_window_s": 2,
                              "scale_down_delay_s": 2}})
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    wait_served(client, "cold")
    time.sleep(2)
    assert stack.client.status("cold")["replicas"] == []  # min 0 and no demand: nothing runs

    started = time.monotonic()
    r = client.completions.create(model="cold", prompt="Hello", max_tokens=4, timeout=120)
    cold_start = time.monotonic() - started
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.model_extra["strata"]["replica_id"].startswith("cold-r1-")
    assert r.model_extra["strata"]["timings"]["admission_wait"] > 0.5  # it waited in the queue
    print(f"first request at zero replicas completed in {cold_start:.1f} s")

    # Idle past scale_to_zero_after_s: back to zero.
    wait_until(lambda: stack.client.status("cold")["replicas"] == [], 60, "scale to zero")
