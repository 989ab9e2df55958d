"""`strata diagnose` on a live stack: each induced trouble is named at its layer.

Each case loads its own deployment of the shared stack (conftest.py) and runs the real command
(`--since 0`: everything since the services started, which is this deployment's own traffic).
"""

import asyncio
import json
import random
import re
import subprocess
import sys

import aiohttp

from shared import keys
from shared.store import connect_redis
from tests.observability.conftest import STEP_DELAY


def diagnose(stack, deployment: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "services.control.cli", "diagnose", "--deployment", deployment,
                          "--redis-url", stack.infra.redis_url, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


async def complete(http, stack, model: str, prompt, max_tokens: int) -> dict:
    async with http.post(stack.base_url + "/v1/completions",
                         json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
                         headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_too_few_replicas_for_the_load_is_infrastructure(obs_stack):
    async with aiohttp.ClientSession() as http:  # a burst of 16 on one replica that runs 2 at a time
        bodies = await asyncio.gather(*(complete(http, obs_stack, "tiny-a", f"Burst {i} " * 8, 24)
                                        for i in range(16)))
    assert max(b["strata"]["timings"]["admission_wait"] for b in bodies) > 0.2
    # A generous token-latency target: this case is about the queue, on 2 noisy shared CPUs.
    report = json.loads(diagnose(obs_stack, "tiny-a", "--since", "0", "--json", "--itl-slo", "0.5"))
    verdict = report["verdict"]
    assert (verdict["layer"], verdict["area"]) == ("infrastructure", "admission"), report
    assert "of TTFT is admission wait" in verdict["summary"] and verdict["fix"].startswith("add replicas")


async def test_shared_prefixes_under_round_robin_is_infrastructure_routing(obs_stack):
    rng = random.Random(7)
    async with aiohttp.ClientSession() as http:
        for _ in range(10):  # conversations of two turns, one after the other: round robin splits each
            first = [rng.randrange(8, 4000) for _ in range(176)]
            await complete(http, obs_stack, "tiny-b", first, 4)
            await complete(http, obs_stack, "tiny-b", first + [rng.randrange(8, 4000) for _ in range(16)], 4)
    report = json.loads(diagnose(obs_stack, "tiny-b", "--json", "--itl-slo", "0.5"))  # default window: 5m
    verdict = report["verdict"]
    assert (verdict["layer"], verdict["area"]) == ("infrastructure", "routing"), report
    assert "requests sharing prefixes are spread across replicas" in verdict["summary"]
    assert "use kv_aware (now round_robin)" in verdict["fix"]


async def test_a_slow_engine_is_the_runtime(obs_stack):
    async with aiohttp.ClientSession() as http:
        for i in range(3):  # one at a time: no load to blame
            await complete(http, obs_stack, "tiny-c", f"Slow {i}", 8)
    text = diagnose(obs_stack, "tiny-c", "--since", "0")
    verdict = next(line for line in text.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: runtime: inter-token latency") and "at low concurrency" in verdict, text
    assert "\nruntime\n  engine engine-c0 (tiny-c) ready" in text and "\ninfrastructure\n" in text
    assert "step " in text and ": other " in text  # the step delay is time outside every named phase
    assert "fix: time outside every named phase dominates" in text

    # The engine's own /metrics: the phases add up to the step wall time; the delay is in `other`.
    report = json.loads(diagnose(obs_stack, "tiny-c", "--since", "0", "--json"))
    engine_line = next(line for line in report["state"]["runtime"] if "engine-c0" in line)
    assert int(re.search(r"step (\d+) ms", engine_line).group(1)) >= STEP_DELAY * 1e3
    redis = connect_redis(obs_stack.infra.redis_url)
    url = (await redis.hget(keys.replica("engine-c0"), "http_url")).decode()
    await redis.aclose()
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    sums = {line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("strata:engine_step_seconds_sum{")}
    wall = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("strata:engine_step_duration_seconds_sum{"))
    steps = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("strata:engine_step_duration_seconds_count{"))
    assert steps >= 24 and abs(sum(sums.values()) - wall) < 1e-3 and sums["other"] >= STEP_DELAY * steps
