"""Soak: the local stack at saturation for N minutes, then the leak checks.

Clients keep more requests in flight than the engines can run at once (so the schedulers'
admission queues stay non-empty): a mix of prompt lengths, shared prefixes, streamed and
non-streamed completions, and clients that hang up mid-stream. Afterwards:

- KV blocks leaked: blocks still held by a sequence on any engine once every request has ended
  (the engine's used blocks; blocks kept only by the prefix cache are free and evictable, and do
  not count). Must be 0.
- Hung requests: requests that had no final answer (completion, error, or the client's own
  hang-up) within their deadline plus a grace period. Must be 0.
- Resident memory (VmRSS) of every service process at the end against the end of the warm-up
  (the first fifth of the run, at least 30 s). Growth must be under 10% for each.

Prints the figures and writes bench/results/soak.json; exits 1 if a check fails.

    python bench/soak.py [--minutes 10] [--engines 2] [--concurrency 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from bench.common import write_results  # noqa: E402
from shared import keys  # noqa: E402
from shared.localstack import LocalStack  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

REQUEST_TIMEOUT = 60.0  # each request's deadline (Strata-Timeout)
HUNG_AFTER = REQUEST_TIMEOUT + 15.0  # past this, a request that has not ended is hung


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def service_pids(stack: LocalStack) -> dict[str, int]:
    pids = {name: proc.pid for name, proc in stack.services.items()}
    pids.update({p.name: p.proc.pid for p in stack.infra.processes})  # nats, valkey: for the record
    return pids


class Clients:
    def __init__(self, stack: LocalStack, concurrency: int, seed: int):
        self.stack, self.concurrency = stack, concurrency
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(8, 4000) for _ in range(96)] for _ in range(8)]
        self.outcomes: Counter[str] = Counter()
        self.tokens = 0
        self.stopping = asyncio.Event()

    def body(self) -> tuple[dict, bool]:
        rng = self.rng
        prompt = [rng.randrange(8, 4000) for _ in range(rng.randrange(8, 160))]
        if rng.random() < 0.5:  # a shared prefix: prefix-cache hits, evictions, KV-aware routing
            prompt = rng.choice(self.prefixes) + prompt
        stream = rng.random() < 0.7
        body = {"model": self.stack.deployment, "prompt": prompt, "max_tokens": rng.randrange(8, 160),
                "temperature": rng.choice([0.0, 0.8]), "ignore_eos": rng.random() < 0.8, "stream": stream}
        hang_up = stream and rng.random() < 0.1
        return body, hang_up

    async def one(self, http: aiohttp.ClientSession) -> str:
        body, hang_up = self.body()
        headers = {"Authorization": f"Bearer {self.stack.api_key}", "Strata-Timeout": str(REQUEST_TIMEOUT)}
        async with http.post(self.stack.base_url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                return f"http_{resp.status}"
            if not body["stream"]:
                self.tokens += (await resp.json())["usage"]["completion_tokens"]
                return "completed"
            events = 0
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error_{event['error'].get('code')}"
                events += 1
                if event.get("usage"):
                    self.tokens += event["usage"]["completion_tokens"]
                if hang_up and events >= 3:
                    resp.connection.transport.abort()  # the client vanishes mid-stream
                    return "hung_up"
            return "completed"

    async def client(self, http: aiohttp.ClientSession) -> None:
        while not self.stopping.is_set():
            try:
                outcome = await asyncio.wait_for(self.one(http), HUNG_AFTER)
            except asyncio.TimeoutError:
                outcome = "hung"
            except aiohttp.ClientError as exc:
                outcome = f"client_error_{exc.__class__.__name__}"
            self.outcomes[outcome] += 1

    async def run(self, seconds: float, on_warm, warm_after: float) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            tasks = [asyncio.create_task(self.client(http)) for _ in range(self.concurrency)]
            await asyncio.sleep(warm_after)
            on_warm()
            await asyncio.sleep(seconds - warm_after)
            self.stopping.set()
            await asyncio.wait_for(asyncio.gather(*tasks), HUNG_AFTER + 10)


async def engine_state(stack: LocalStack) -> dict[str, dict]:
    """Per engine: used and total KV blocks, running and waiting requests, from its /metrics."""
    import redis.asyncio as aioredis

    redis = aioredis.Redis.from_url(stack.infra.redis_url)
    out = {}
    try:
        async with aiohttp.ClientSession() as http:
            for name in [n for n in stack.services if n.startswith("engine-")]:
                entry = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.replica(name))).items()}
                async with http.get(entry["http_url"] + "/metrics") as resp:
                    text = await resp.text()
                figures = {}
                for metric in ("strata:kv_cache_usage_perc", "strata:num_requests_running",
                               "strata:num_requests_waiting"):
                    figures[metric] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                          if line.startswith(metric + "{"))
                total = int(entry["kv_blocks_total"])
                out[name] = {"kv_blocks_total": total,
                             "kv_blocks_used": round(figures["strata:kv_cache_usage_perc"] * total),
                             "running": int(figures["strata:num_requests_running"]),
                             "waiting": int(figures["strata:num_requests_waiting"])}
    finally:
        await redis.aclose()
    return out


async def soak(args: argparse.Namespace, stack: LocalStack) -> dict:
    clients = Clients(stack, args.concurrency, args.seed)
    pids = service_pids(stack)
    warm: dict[str, int] = {}
    samples: list[dict] = []
    seconds = args.minutes * 60
    warm_after = max(seconds / 5, min(30.0, seconds / 2))

    async def sample() -> None:  # memory, and how full the engines are (saturated: running = max_num_seqs)
        start = time.monotonic()
        while True:
            load = {n: {"running": e["running"], "waiting": e["waiting"]} for n, e in (await engine_state(stack)).items()}
            samples.append({"t": round(time.monotonic() - start, 1), "rss_kib": {n: rss_kib(p) for n, p in pids.items()},
                            "engines": load})
            await asyncio.sleep(10)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    await clients.run(seconds, lambda: warm.update({n: rss_kib(p) for n, p in pids.items()}), warm_after)
    ran = time.monotonic() - started
    sampler.cancel()
    await asyncio.sleep(3)  # the last cancels and final heartbeats land
    engines = await engine_state(stack)
    end = {n: rss_kib(p) for n, p in pids.items()}
    growth = {n: (end[n] - warm[n]) / warm[n] for n in pids}
    services = [n for n in pids if n not in ("nats", "valkey")]
    leaked = sum(e["kv_blocks_used"] for e in engines.values())
    hung = clients.outcomes["hung"]
    checks = {"kv_blocks_leaked_zero": leaked == 0 and all(not e["running"] and not e["waiting"]
                                                           for e in engines.values()),
              "hung_requests_zero": hung == 0,
              "rss_growth_under_10pct": all(growth[n] < 0.10 for n in services)}
    return {"seconds": round(ran, 1), "warm_up_s": round(warm_after, 1), "requests": sum(clients.outcomes.values()),
            "outcomes": dict(clients.outcomes), "completion_tokens": clients.tokens,
            "kv_blocks_leaked": leaked, "engines_after": engines, "hung_requests": hung,
            "rss_kib_warm": warm, "rss_kib_end": end, "rss_growth": {n: round(g, 4) for n, g in growth.items()},
            "samples": samples, "checks": checks, "passed": all(checks.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=48, help="requests kept in flight")
    p.add_argument("--max-num-seqs", type=int, default=16, help="per engine: fewer than the load, so requests queue")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = p.parse_args()

    model = ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    stack = LocalStack(str(model), engines=args.engines,
                       engine_args=["--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs),
                                    "--num-kv-blocks", "1024"])
    stack.start()
    try:
        result = asyncio.run(soak(args, stack))
    finally:
        stack.stop()

    print(f"soak: {result['seconds']:.0f}s at concurrency {args.concurrency} on {args.engines} engines "
          f"(warm-up {result['warm_up_s']:.0f}s): {result['requests']} requests, "
          f"{result['completion_tokens']} completion tokens")
    print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(result["outcomes"].items())))
    print(f"  KV blocks leaked: {result['kv_blocks_leaked']} "
          f"({', '.join(f'{n}: {e}' for n, e in result['engines_after'].items())})")
    print(f"  hung requests: {result['hung_requests']}")
    busy = [e["running"] for s in result["samples"][1:] for e in s["engines"].values()]
    print(f"  engines' running requests while loaded: min {min(busy, default=0)}, max {max(busy, default=0)} "
          f"(max_num_seqs {args.max_num_seqs})")
    for name, growth in result["rss_growth"].items():
        print(f"  RSS {name}: {result['rss_kib_warm'][name] / 1024:.0f} MiB after warm-up -> "
              f"{result['rss_kib_end'][name] / 1024:.0f} MiB at the end ({growth:+.1%})")
    print("  checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in result["checks"].items()))
    write_results(args.out, args, result)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
