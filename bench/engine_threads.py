"""CPU threads of engines sharing one machine: total tokens/s of 4 concurrent streams through the
whole local stack (gateway -> scheduler -> engines), with

- 1 engine, all cores (what one engine alone takes),
- 1 engine, cores / 2 threads (what the first of `strata up`'s two planned engines gets),
- 2 engines, split: cores / 2 threads each (services.engine.launch: what the stack now gives them),
- 2 engines, not split: all cores each (as before: `--threads CORES` given explicitly),
- 2 engines, not split, with OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep at barriers
  instead of spinning: the other remedy, docs/performance.md).

Arms run one after another, `--repeats` times in turn (A B C D A B C D ...), and each arm's
median is reported with its ratio to the first arm; writes bench/results/engine_threads.json.

    flock /tmp/strata-heavy.lock python bench/engine_threads.py [--model DIR] [--rounds 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from bench.common import stream_completion, write_results  # noqa: E402
from services.engine.launch import cpu_cores  # noqa: E402
from shared import aio  # noqa: E402
from shared.localstack import LocalStack  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

STREAMS = 4


def arms(cores: int) -> dict[str, tuple[int, list[str], dict[str, str]]]:
    """name -> (engines, extra engine flags, engine environment); no --threads: the stack's
    own split decides."""
    half = max(cores // 2, 1)
    return {
        f"1 engine x {cores} threads": (1, [], {}),
        f"1 engine x {half} threads": (1, ["--threads", str(half)], {}),
        f"2 engines x {half} threads (split)": (2, [], {}),
        f"2 engines x {cores} threads (not split)": (2, ["--threads", str(cores)], {}),
        f"2 engines x {cores} threads, passive": (2, ["--threads", str(cores)], {"OMP_WAIT_POLICY": "PASSIVE"}),
    }


async def run_arm(stack: LocalStack, prompts: list[list[int]], rounds: int, max_tokens: int) -> dict:
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(stream_completion(http, stack, p, 8) for p in prompts[:STREAMS]))  # warm-up
        replicas: Counter = Counter()
        tokens, start = 0, time.perf_counter()
        for r in range(rounds):
            batch = prompts[r * STREAMS:(r + 1) * STREAMS]
            results = await asyncio.gather(*(stream_completion(http, stack, p, max_tokens) for p in batch))
            for _, final in results:
                tokens += final["usage"]["completion_tokens"]
                replicas[(final.get("strata") or {}).get("replica_id", "?")] += 1
        elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "streams_per_replica": sorted(replicas.values(), reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="model directory (default: the tiny model)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of 4 concurrent streams per measurement")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="times every arm is measured, in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_threads.json"))
    args = parser.parse_args()
    if min(args.rounds, args.max_tokens, args.prompt_len, args.repeats) < 1:
        parser.error("--rounds, --max-tokens, --prompt-len and --repeats must be >= 1")
    model_dir = Path(args.model) if args.model else ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, 4000) for _ in range(args.prompt_len)] for _ in range(STREAMS * args.rounds)]
    cores = cpu_cores()
    print(f"{cores} cores; {STREAMS} concurrent streams x {args.rounds} rounds x {args.max_tokens} tokens, "
          f"model {model_dir}", flush=True)

    measured: dict[str, list[dict]] = {name: [] for name in arms(cores)}
    for repeat in range(args.repeats):
        for name, (engines, flags, env) in arms(cores).items():
            engine_args = ["--num-kv-blocks", "1024", "--max-num-seqs", "16", "--log-level", "warning", *flags]
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the stack's processes start with this environment
            try:
                with LocalStack(str(model_dir), engines=engines, engine_args=engine_args,
                                gateway_args=["--log-level", "warning"],
                                scheduler_args=["--log-level", "warning"]) as stack:
                    result = aio.run(run_arm(stack, prompts, args.rounds, args.max_tokens))
            finally:
                for k, v in saved.items():
                    if v is None:
                        del os.environ[k]
                    else:
                        os.environ[k] = v
            measured[name].append(result)
            print(f"  [{repeat + 1}/{args.repeats}] {name:40s} {result['tokens_per_s']:7.1f} tok/s "
                  f"(streams per replica {result['streams_per_replica']})", flush=True)

    base = None
    summary = {}
    for name, results in measured.items():
        median = statistics.median(r["tokens_per_s"] for r in results)
        base = base or median
        summary[name] = {"tokens_per_s_median": median, "ratio_to_first": median / base}
        print(f"{name:40s} {median:7.1f} tok/s  {median / base:5.2f}x", flush=True)
    write_results(args.out, args, {"cores": cores, "streams": STREAMS, "arms": measured, "summary": summary})


if __name__ == "__main__":
    main()
