"""Where the step loop runs: a thread of the caller's process (AsyncLLMEngine, engine_core=thread)
vs an engine core process of its own (CoreClient, engine_core=process), the same engine args.

Both clients are started once per model and measured side by side, their rounds alternating
(thread, process, thread, ...), so that the machine's noise falls on both: TTFT p50 at
concurrency 1 and tokens/s at concurrency 32, on the tiny model and on the realistic bench's M
shape (bf16). Prints the figures and their ratios; writes bench/results/engine_core.json.

    STRATA_HOME=/work/strata-home python bench/engine_core.py [--models tiny,M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import percentile, write_results  # noqa: E402
from services.engine import SamplingParams  # noqa: E402
from services.engine.async_engine import AsyncLLMEngine  # noqa: E402
from services.engine.core_client import CoreClient  # noqa: E402
from shared import aio  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

ENGINE_ARGS = dict(max_num_seqs=64, num_kv_blocks=4096)
ARMS = {"thread": AsyncLLMEngine, "process": CoreClient}
PROMPT_TOKENS = 64


def model_dir(name: str) -> Path:
    if name == "tiny":
        return ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    from shared.realistic_models import ensure_model

    return ensure_model(name)


async def one(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, tokens = None, 0
    async for out in engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True)):
        if out.new_token_ids and ttft is None:
            ttft = time.perf_counter() - start
        tokens += len(out.new_token_ids)
    return ttft, tokens


async def bench_model(name: str, args) -> dict:
    path = model_dir(name)
    engines = {arm: cls.from_model(path, **ENGINE_ARGS) for arm, cls in ARMS.items()}
    for engine in engines.values():
        await engine.start()
    vocab = min(e.limits.vocab_size for e in engines.values())
    rng = random.Random(args.seed)
    ids = itertools.count()

    def prompt() -> list[int]:
        return [rng.randrange(8, vocab) for _ in range(PROMPT_TOKENS)]

    ttfts: dict[str, list[float]] = {arm: [] for arm in engines}
    c32: dict[str, list[tuple[int, float]]] = {arm: [] for arm in engines}
    try:
        for arm, engine in engines.items():  # warm-up: first steps of each shape, allocator
            await asyncio.gather(*(one(engine, f"w{next(ids)}", prompt(), 8) for _ in range(4)))
        for _ in range(args.rounds):
            for arm, engine in engines.items():
                for _ in range(args.requests_c1):
                    ttfts[arm].append((await one(engine, f"r{next(ids)}", prompt(), 4))[0])
            for arm, engine in engines.items():
                start = time.perf_counter()
                results = await asyncio.gather(*(one(engine, f"r{next(ids)}", prompt(), args.max_tokens)
                                                 for _ in range(32)))
                c32[arm].append((sum(t for _, t in results), time.perf_counter() - start))
    finally:
        for engine in engines.values():
            await engine.shutdown()
    out = {}
    for arm in engines:
        tokens, elapsed = sum(t for t, _ in c32[arm]), sum(s for _, s in c32[arm])
        out[arm] = {"ttft_p50_ms": percentile(ttfts[arm], 0.5) * 1e3, "ttft_p99_ms": percentile(ttfts[arm], 0.99) * 1e3,
                    "c32_tokens_per_s": tokens / elapsed, "c32_tokens": tokens}
        print(f"{name:5s} {arm:8s} TTFT p50 {out[arm]['ttft_p50_ms']:7.2f} ms  p99 {out[arm]['ttft_p99_ms']:7.2f} ms  "
              f"c32 {out[arm]['c32_tokens_per_s']:8.0f} tok/s", flush=True)
    out["process_vs_thread"] = {
        "c32_throughput_ratio": out["process"]["c32_tokens_per_s"] / out["thread"]["c32_tokens_per_s"],
        "ttft_p50_delta_ms": out["process"]["ttft_p50_ms"] - out["thread"]["ttft_p50_ms"]}
    ratio = out["process_vs_thread"]
    print(f"{name:5s} process/thread: c32 throughput x{ratio['c32_throughput_ratio']:.3f}, "
          f"TTFT p50 {ratio['ttft_p50_delta_ms']:+.2f} ms", flush=True)
    return out


async def main_async(args) -> dict:
    return {name: await bench_model(name, args) for name in args.models.split(",")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,M", help="tiny and/or realistic shapes (shared.realistic_models)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both measurements per arm")
    parser.add_argument("--requests-c1", type=int, default=20, help="sequential requests per arm per round")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request at concurrency 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_core.json"))
    args = parser.parse_args()
    write_results(args.out, args, aio.run(main_async(args)))


if __name__ == "__main__":
    main()
