"""KV-aware routing vs round-robin and least-load on a shared-prefix conversation workload.

4 engine workers on the tiny model (one torch thread each), a scheduler and a gateway, started
fresh for each policy. The workload, like the llm-d and SGLang router benchmarks: many
multi-turn conversations, each opening with one of a few long system prompts; every turn sends
the whole history (system prompt, earlier user turns and replies) plus a new user message.
Per policy: prefix-cache hit rate (from usage.prompt_tokens_details.cached_tokens), TTFT p50/p90,
throughput, and the share of requests each replica served. The oracle is the hit rate of a
router that always finds every block ever computed (an unbounded single cache): no routing can
beat it. Writes bench/results/routing.json and routing.png.

    python bench/routing.py [--conversations 48] [--turns 3] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from bench.common import percentile, stream_completion, pyplot, write_results  # noqa: E402
from shared import aio  # noqa: E402
from shared.block_hash import prompt_block_hashes  # noqa: E402
from shared.localstack import LocalStack  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

BLOCK = 16
POLICIES = ("round_robin", "least_load", "kv_aware")


def make_workload(args) -> list[dict]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(8, 4000) for _ in range(args.system_tokens)] for _ in range(args.system_prompts)]
    return [{"id": i, "system": systems[rng.randrange(len(systems))],
             "users": [[rng.randrange(8, 4000) for _ in range(rng.randint(20, 60))] for _ in range(args.turns)]}
            for i in range(args.conversations)]


async def converse(http, stack, conv, args, records, seen_blocks) -> None:
    history = list(conv["system"])
    for turn, user in enumerate(conv["users"]):
        prompt = history + user
        ttft, final = await stream_completion(http, stack, prompt, args.output_tokens)
        usage, strata = final["usage"], final.get("strata")
        # The reply re-enters the history as fixed made-up tokens (the API returns text, not
        # token ids): every policy and the oracle see exactly the same prompts.
        reply = [8 + (conv["id"] * 7919 + turn * 104729 + i * 31) % 3990 for i in range(usage["completion_tokens"])]
        # Oracle: longest chain of full blocks of this prompt ever computed by any replica.
        hashes = prompt_block_hashes(prompt, BLOCK)
        hit_blocks = 0
        for h in hashes[: (len(prompt) - 1) // BLOCK]:
            if h not in seen_blocks:
                break
            hit_blocks += 1
        seen_blocks.update(hashes)
        records.append({"ttft": ttft, "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                        "oracle_cached_tokens": hit_blocks * BLOCK, "completion_tokens": usage["completion_tokens"],
                        "replica": strata["replica_id"] if strata else None})
        history = prompt + reply


async def run_policy(policy: str, model_dir: Path, args, workload) -> dict:
    engine_flags = ["--threads", "1", "--num-kv-blocks", str(args.kv_blocks), "--log-level", "warning"]
    with LocalStack(str(model_dir), engines=4, engine_args=engine_flags,
                    scheduler_args=["--policy", policy, "--load-weight", str(args.load_weight),
                                    "--log-level", "warning"],
                    gateway_args=["--log-level", "warning"]) as stack:
        await asyncio.sleep(1.5)  # the scheduler has heard every replica
        records: list[dict] = []
        seen: set[int] = set()
        sem = asyncio.Semaphore(args.concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency * 2)) as http:
            async def one(conv):
                async with sem:
                    await converse(http, stack, conv, args, records, seen)

            start = time.perf_counter()
            await asyncio.gather(*(one(c) for c in workload))
            elapsed = time.perf_counter() - start
    prompt = sum(r["prompt_tokens"] for r in records)
    shares = Counter(r["replica"] for r in records)
    return {
        "requests": len(records),
        "hit_rate": sum(r["cached_tokens"] for r in records) / prompt,
        "oracle_hit_rate": sum(r["oracle_cached_tokens"] for r in records) / prompt,
        "ttft_p50_ms": percentile([r["ttft"] for r in records], 0.5) * 1e3,
        "ttft_p90_ms": percentile([r["ttft"] for r in records], 0.9) * 1e3,
        "throughput_tok_s": sum(r["completion_tokens"] for r in records) / elapsed,
        "seconds": elapsed,
        "max_replica_share": max(shares.values()) / len(records),
        "replica_shares": {k: v / len(records) for k, v in sorted(shares.items(), key=lambda kv: str(kv[0]))},
    }


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [results[n]["hit_rate"] * 100 for n in names], color="#4c72b0")
    axes[0].axhline(results["kv_aware"]["oracle_hit_rate"] * 100, color="k", ls="--", label="oracle")
    axes[0].set_ylabel("prefix cache hit rate (%)")
    axes[0].legend()
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [results[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [results[n]["ttft_p90_ms"] for n in names], 0.4, label="p90")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend()
    axes[2].bar(names, [results[n]["throughput_tok_s"] for n in names], color="#55a868")
    axes[2].set_ylabel("output tokens/s")
    fig.suptitle("Routing policies: 4 tiny-model engines, shared-prefix conversations")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


async def main_async(args) -> dict:
    model_dir = Path(args.model) if args.model else ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    workload = make_workload(args)
    results = {}
    for policy in POLICIES:
        results[policy] = r = await run_policy(policy, model_dir, args, workload)
        print(f"{policy:12s} hit {r['hit_rate']:.1%} (oracle {r['oracle_hit_rate']:.1%})  "
              f"TTFT p50 {r['ttft_p50_ms']:.1f} ms p90 {r['ttft_p90_ms']:.1f} ms  "
              f"{r['throughput_tok_s']:.0f} tok/s  max replica share {r['max_replica_share']:.0%}", flush=True)
    kv, rr = results["kv_aware"], results["round_robin"]
    summary = {"kv_aware_vs_oracle_hit": kv["hit_rate"] / kv["oracle_hit_rate"],
               "kv_aware_ttft_p50_vs_round_robin": kv["ttft_p50_ms"] / rr["ttft_p50_ms"],
               "kv_aware_max_replica_share": kv["max_replica_share"]}
    print(f"kv_aware reaches {summary['kv_aware_vs_oracle_hit']:.0%} of the oracle hit rate (target >= 90%); "
          f"TTFT p50 {summary['kv_aware_ttft_p50_vs_round_robin']:.2f}x round_robin's (target <= 0.5); "
          f"max replica share {summary['kv_aware_max_replica_share']:.0%} (target <= 40%)")
    return {"results": results, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=24)
    parser.add_argument("--system-tokens", type=int, default=320)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=256,
                        help="per engine: smaller than all system prompts together, as in a real fleet")
    parser.add_argument("--load-weight", type=float, default=4.0, help="the scheduler's kv_aware load weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "routing.json"))
    args = parser.parse_args()
    out = aio.run(main_async(args))
    write_results(args.out, args, out)
    plot(out["results"], Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
