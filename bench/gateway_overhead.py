"""What the HTTP path costs: the full stack (gateway -> scheduler -> engine over NATS, SSE back)
vs the same engine called in-process, at concurrency 1 and 32, and where the difference goes.

Prints, for both arms: TTFT p50/p99 at concurrency 1 and tokens/s at concurrency 32 (and the
added latency and the throughput ratio); the c1 TTFT split into its parts (a max_tokens=1
request: the hop layers of shared/layers.py over HTTP, the engine's queue/prefill in-process);
the engine's step phases at c32 (StepTimings: ms per step, tokens per step, the share of the wall
time the engine spent stepping); CPU seconds per generated token of every process (gateway,
scheduler, engine, nats-server, valkey, the bench's own client) at c1 and c32, and what the
machine's other users took meanwhile. With `--profile DIR`, each arm's c32 rounds run once more under
py-spy (`record --native`, speedscope files in DIR and a top-functions summary in the JSON); its
figures are not the measured ones (py-spy pauses the processes it samples).
Writes bench/results/gateway_overhead.json.

    python bench/gateway_overhead.py [--model DIR] [--num-threads N] [--profile DIR [--profile-idle]]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from services.engine import SamplingParams  # noqa: E402
from services.engine.async_engine import AsyncLLMEngine  # noqa: E402
from services.engine.config import EngineArgs  # noqa: E402
from services.engine.model_runner import STEP_PHASES  # noqa: E402
from bench.common import percentile, stream_completion, write_results  # noqa: E402
from bench.process_profile import CpuWindow, PySpy, format_cpu, format_profile, pyspy_binary  # noqa: E402
from shared import aio  # noqa: E402
from shared.layers import LAYER_NAMES  # noqa: E402
from shared.localstack import LocalStack, free_port  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

ENGINE_ARGS = dict(max_num_seqs=64, num_kv_blocks=4096)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 4000) for _ in range(64)] for _ in range(n)]


@dataclass
class Reply:
    ttft_s: float
    tokens: int
    parts: dict[str, float] = field(default_factory=dict)  # the first token's time, by part (seconds)


@dataclass
class Arm:
    """One way of reaching the engine: a request call, the processes doing the work, and the
    engine's cumulative step phases (StepTimings fields summed, `steps`, `wall`)."""
    name: str
    call: Callable[[list[int], int], Awaitable[Reply]]
    pids: dict[str, int]
    step_totals: Callable[[], Awaitable[dict[str, float]]]


async def inproc_one(engine: AsyncLLMEngine, rid: str, prompt: list[int], max_tokens: int) -> Reply:
    start = time.perf_counter()
    ttft, tokens, parts = None, 0, {}
    async for out in engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True)):
        if out.new_token_ids and ttft is None:
            ttft = time.perf_counter() - start
            t = out.metrics.timings()  # the engine's own queue and prefill (monotonic seconds)
            parts = {"engine_queue": t.get("queue", 0.0), "engine_prefill": t.get("prefill", 0.0)}
            parts["handoff"] = ttft - parts["engine_queue"] - parts["engine_prefill"]
        tokens += len(out.new_token_ids)
    return Reply(ttft, tokens, parts)


async def http_one(http: aiohttp.ClientSession, stack: LocalStack, prompt: list[int], max_tokens: int) -> Reply:
    ttft, final = await stream_completion(http, stack, prompt, max_tokens)
    timings = final.get("strata", {}).get("timings")
    parts = {}
    if timings:  # absent: the gateway did not say (the split then reports the TTFT alone)
        parts = {name: timings.get(name, 0.0) for name in LAYER_NAMES}
        # The client's side: its HTTP request reaching the gateway, the SSE event coming back.
        parts["client_http"] = ttft - timings.get("e2e", 0.0)
    return Reply(ttft, final["usage"]["completion_tokens"], parts)


def step_delta(before: dict[str, float], after: dict[str, float], elapsed: float, tokens: int) -> dict:
    """The engine's steps in a window: ms per step by phase, tokens per step, and how much of the
    window it spent stepping (the rest it waited for work)."""
    steps = after["steps"] - before["steps"]
    wall = after["wall"] - before["wall"]
    per = 1e3 / max(steps, 1)
    return {"steps": int(steps), "tokens_per_step": round(tokens / max(steps, 1), 2),
            "step_ms": round(wall * per, 4),
            "phase_ms": {p: round((after[p] - before[p]) * per, 4) for p in STEP_PHASES},
            "busy_fraction": round(wall / elapsed, 4),
            "gap_ms_per_step": round((elapsed - wall) * per, 4)}


async def measure(arm: Arm, ps: list[list[int]], split_ps: list[list[int]], args, profiler: PySpy | None) -> dict:
    for p in ps[:3]:  # warm-up
        await arm.call(p, 8)

    cpu = CpuWindow(arm.pids).start()
    c1 = [await arm.call(p, 16) for p in ps[:args.requests_c1]]
    ttfts = [r.ttft_s for r in c1]
    cpu_c1 = cpu.stop(sum(r.tokens for r in c1))

    # The first token alone (max_tokens=1: the final chunk carries it and the hop timestamps).
    split = [await arm.call(p, 1) for p in split_ps]  # prompts not seen before: no prefix-cache hits
    parts = {k: round(statistics.fmean(r.parts[k] for r in split) * 1e3, 4) for k in split[0].parts}

    steps0 = await arm.step_totals()
    cpu = CpuWindow(arm.pids).start()
    start = time.perf_counter()
    total = 0
    for r in range(args.rounds_c32):
        batch = ps[r * 32:(r + 1) * 32]
        results = await asyncio.gather(*(arm.call(p, 128) for p in batch))
        total += sum(t.tokens for t in results)
    elapsed = time.perf_counter() - start
    cpu_c32 = cpu.stop(total)
    steps = step_delta(steps0, await arm.step_totals(), elapsed, total)

    out = {"ttft_p50_ms": percentile(ttfts, 0.5) * 1e3, "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
           "c32_tokens_per_s": total / elapsed, "c32_tokens": total,
           "ttft_split_ms": {"ttft_mean": round(statistics.fmean(r.ttft_s for r in split) * 1e3, 4), **parts},
           "c32_steps": steps, "cpu_c1": cpu_c1, "cpu_c32": cpu_c32}
    if profiler is not None:  # the c32 rounds once more, profiled (not the measured ones)
        profiler.start(arm.name, {k: v for k, v in arm.pids.items() if k not in ("nats", "valkey")})
        start = time.perf_counter()
        total = 0
        for r in range(args.rounds_c32):
            total += sum(t.tokens for t in await asyncio.gather(*(arm.call(p, 128) for p in ps[r * 32:(r + 1) * 32])))
        elapsed = time.perf_counter() - start
        out["profile"] = {"c32_tokens_per_s_under_pyspy": total / elapsed, "processes": profiler.stop()}
    return out


def report(name: str, r: dict) -> None:
    s, split = r["c32_steps"], r["ttft_split_ms"]
    print(f"{name:<11} TTFT p50 {r['ttft_p50_ms']:.2f} ms  p99 {r['ttft_p99_ms']:.2f} ms  "
          f"c32 {r['c32_tokens_per_s']:.0f} tok/s", flush=True)
    print("  first token (max_tokens=1, mean ms): "
          + ", ".join(f"{k} {v:.3f}" for k, v in split.items() if v or k == "ttft_mean"))
    print(f"  c32 steps: {s['steps']}, {s['tokens_per_step']:.1f} tokens/step, {s['step_ms']:.3f} ms/step "
          f"(" + ", ".join(f"{p} {v:.3f}" for p, v in s["phase_ms"].items() if v) + f"); engine busy "
          f"{s['busy_fraction']:.0%} of the wall time, {s['gap_ms_per_step']:.3f} ms between steps")
    for phase in ("cpu_c1", "cpu_c32"):
        print(f"  CPU per generated token, {phase[4:]}:\n{format_cpu(r[phase])}")
    for proc, summary in r.get("profile", {}).get("processes", {}).items():
        print(format_profile(proc, summary))


async def inproc_arm(model_dir: Path, engine_args: dict, ps, split_ps, args, profiler) -> dict:
    engine = AsyncLLMEngine.from_model(model_dir, **engine_args)
    await engine.start()
    counter = iter(range(10**9))

    async def totals() -> dict[str, float]:
        return dataclasses.asdict(engine.engine.step_timings)

    arm = Arm("in_process", lambda p, m: inproc_one(engine, f"r{next(counter)}", p, m),
              {"bench": os.getpid()}, totals)
    try:
        return await measure(arm, ps, split_ps, args, profiler)
    finally:
        await engine.shutdown()


async def scrape_steps(http: aiohttp.ClientSession, metrics_url: str) -> dict[str, float]:
    """The engine's cumulative step phases from its /metrics (strata:engine_step_seconds)."""
    async with http.get(metrics_url) as resp:
        text = await resp.text()
    out = {p: 0.0 for p in STEP_PHASES} | {"wall": 0.0, "steps": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "strata:engine_step_seconds_sum":
                out[sample.labels["phase"]] += sample.value
            elif sample.name == "strata:engine_step_duration_seconds_sum":
                out["wall"] += sample.value
            elif sample.name == "strata:engine_step_duration_seconds_count":
                out["steps"] += sample.value
    return out


async def http_arm(model_dir: Path, engine_args: dict, ps, split_ps, args, profiler) -> dict:
    metrics_port = free_port()
    spec = {"max_num_seqs": engine_args["max_num_seqs"], "num_kv_blocks": engine_args["num_kv_blocks"]}
    if engine_args.get("num_threads"):
        spec["threads"] = engine_args["num_threads"]  # num_threads' flag and spec key
    engine_flags = [*EngineArgs.cli_flags(spec), "--http-port", str(metrics_port), "--log-level", "warning"]
    with LocalStack(str(model_dir), engines=1, engine_args=engine_flags,
                    gateway_args=["--log-level", "warning"]) as stack:
        pids = {name.split("-")[0]: proc.pid for name, proc in stack.services.items()}
        pids |= {p.name: p.proc.pid for p in stack.infra.processes}
        pids["client"] = os.getpid()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            arm = Arm("http", lambda p, m: http_one(http, stack, p, m), pids,
                      lambda: scrape_steps(http, f"http://127.0.0.1:{metrics_port}/metrics"))
            return await measure(arm, ps, split_ps, args, profiler)


async def main_async(args) -> dict:
    model_dir = Path(args.model) if args.model else ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    ps = prompts(max(args.requests_c1, 32 * args.rounds_c32), args.seed)
    split_ps = prompts(args.requests_c1, args.seed + 1)
    engine_args = ENGINE_ARGS | ({"num_threads": args.num_threads} if args.num_threads else {})
    profiler = PySpy(Path(args.profile), args.profile_rate, args.profile_idle) if args.profile else None

    inproc = await inproc_arm(model_dir, engine_args, ps, split_ps, args, profiler)
    report("in-process", inproc)
    full = await http_arm(model_dir, engine_args, ps, split_ps, args, profiler)
    report("HTTP path", full)

    summary = {"added_ttft_p50_ms": full["ttft_p50_ms"] - inproc["ttft_p50_ms"],
               "added_ttft_p99_ms": full["ttft_p99_ms"] - inproc["ttft_p99_ms"],
               "c32_throughput_ratio": full["c32_tokens_per_s"] / inproc["c32_tokens_per_s"],
               "c32_cpu_per_token_ratio": (full["cpu_c32"]["total_cpu_ms_per_token"]
                                           / inproc["cpu_c32"]["total_cpu_ms_per_token"]),
               "c32_step_ms_ratio": full["c32_steps"]["step_ms"] / inproc["c32_steps"]["step_ms"]}
    print(f"added TTFT p50 {summary['added_ttft_p50_ms']:.2f} ms (target < 3), "
          f"p99 {summary['added_ttft_p99_ms']:.2f} ms; "
          f"c32 throughput ratio {summary['c32_throughput_ratio']:.3f} (target >= 0.9); c32 CPU per token "
          f"{summary['c32_cpu_per_token_ratio']:.2f}x, engine step time {summary['c32_step_ms_ratio']:.2f}x")
    return {"in_process": inproc, "http": full, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--requests-c1", type=int, default=60)
    parser.add_argument("--rounds-c32", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=0,
                        help="the engine's torch threads in both arms (0: torch's default, one per core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="py-spy each arm's processes during one extra c32 round; speedscope files go to DIR")
    parser.add_argument("--profile-rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--profile-idle", action="store_true", help="py-spy --idle: include waiting threads")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gateway_overhead.json"))
    args = parser.parse_args()
    if args.profile and pyspy_binary() is None:
        parser.error("--profile needs py-spy, which is not installed: pip install py-spy==0.4.3 "
                     "(or pip install -e '.[profile]')")
    write_results(args.out, args, aio.run(main_async(args)))


if __name__ == "__main__":
    main()
