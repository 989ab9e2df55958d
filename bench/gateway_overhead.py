"""What the HTTP path costs: the full stack (gateway -> scheduler -> engine over NATS, SSE back)
vs the same engine called in-process, at concurrency 1 and 32.

Prints TTFT p50/p99 for both and the added latency, and tokens/s for both and their ratio;
writes bench/results/gateway_overhead.json.

    python bench/gateway_overhead.py [--requests-c1 60] [--rounds-c32 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from services.engine import SamplingParams  # noqa: E402
from services.engine.async_engine import AsyncLLMEngine  # noqa: E402
from bench.common import percentile, stream_completion, write_results  # noqa: E402
from shared import aio  # noqa: E402
from shared.localstack import LocalStack  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

ENGINE_ARGS = dict(max_num_seqs=64, num_kv_blocks=4096)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 4000) for _ in range(64)] for _ in range(n)]


async def inproc_one(engine: AsyncLLMEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, tokens = None, 0
    async for out in engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True)):
        if out.new_token_ids and ttft is None:
            ttft = time.perf_counter() - start
        tokens += len(out.new_token_ids)
    return ttft, tokens


async def http_one(http: aiohttp.ClientSession, stack: LocalStack, prompt: list[int], max_tokens: int
                   ) -> tuple[float, int]:
    ttft, final = await stream_completion(http, stack, prompt, max_tokens)
    return ttft, final["usage"]["completion_tokens"]


async def measure(call, ps: list[list[int]], n_c1: int, rounds_c32: int) -> dict:
    for p in ps[:3]:  # warm-up
        await call(p, 8)
    ttfts = [(await call(p, 16))[0] for p in ps[:n_c1]]
    start = time.perf_counter()
    total = 0
    for r in range(rounds_c32):
        batch = ps[r * 32:(r + 1) * 32]
        results = await asyncio.gather(*(call(p, 128) for p in batch))
        total += sum(t for _, t in results)
    elapsed = time.perf_counter() - start
    return {"ttft_p50_ms": percentile(ttfts, 0.5) * 1e3, "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
            "c32_tokens_per_s": total / elapsed, "c32_tokens": total}


async def main_async(args) -> dict:
    model_dir = Path(args.model) if args.model else ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    ps = prompts(max(args.requests_c1, 32 * args.rounds_c32), args.seed)

    engine = AsyncLLMEngine.from_model(model_dir, **ENGINE_ARGS)
    await engine.start()
    counter = iter(range(10**9))
    inproc = await measure(lambda p, m: inproc_one(engine, f"r{next(counter)}", p, m), ps, args.requests_c1,
                           args.rounds_c32)
    await engine.shutdown()

    print(f"in-process  TTFT p50 {inproc['ttft_p50_ms']:.2f} ms  p99 {inproc['ttft_p99_ms']:.2f} ms  "
          f"c32 {inproc['c32_tokens_per_s']:.0f} tok/s", flush=True)

    engine_flags = ["--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]), "--num-kv-blocks",
                    str(ENGINE_ARGS["num_kv_blocks"]), "--log-level", "warning"]
    with LocalStack(str(model_dir), engines=1, engine_args=engine_flags,
                    gateway_args=["--log-level", "warning"]) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            full = await measure(lambda p, m: http_one(http, stack, p, m), ps, args.requests_c1, args.rounds_c32)
    print(f"HTTP path   TTFT p50 {full['ttft_p50_ms']:.2f} ms  p99 {full['ttft_p99_ms']:.2f} ms  "
          f"c32 {full['c32_tokens_per_s']:.0f} tok/s", flush=True)
    summary = {"added_ttft_p50_ms": full["ttft_p50_ms"] - inproc["ttft_p50_ms"],
               "added_ttft_p99_ms": full["ttft_p99_ms"] - inproc["ttft_p99_ms"],
               "c32_throughput_ratio": full["c32_tokens_per_s"] / inproc["c32_tokens_per_s"]}
    print(f"added TTFT p50 {summary['added_ttft_p50_ms']:.2f} ms (target < 3), "
          f"p99 {summary['added_ttft_p99_ms']:.2f} ms; "
          f"c32 throughput ratio {summary['c32_throughput_ratio']:.3f} (target >= 0.9)")
    return {"in_process": inproc, "http": full, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--requests-c1", type=int, default=60)
    parser.add_argument("--rounds-c32", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gateway_overhead.json"))
    args = parser.parse_args()
    write_results(args.out, args, aio.run(main_async(args)))


if __name__ == "__main__":
    main()
