"""What structured outputs cost: 32 concurrent json_schema requests against 32 unconstrained
ones, over HTTP through the full stack (gateway -> scheduler -> engine), side by side in one run.

Both arms stream 128 tokens per request (greedy, ignore_eos): the schema (an object holding at
least 40 records of an integer, a boolean and a short string) cannot close within them, so both
arms generate the same number of tokens and the difference is the token masks (filled on the
host for each structured row, applied in the sampler) and the matchers' advance. Rounds come
in pairs, one of each arm back to back (the order alternating), and the ratio reported is the
median of the pairs' ratios: on a shared 2-core machine one round can run several times slower
than the next, and a pair sees the same load. The schema's first compile (cold; later requests
hit the cache) and the masks' work per step in-process are timed apart.

Prints tokens/s for both arms, the pairs' ratios and their median (target >= 0.8); writes
bench/results/structured.json.

    python bench/structured.py [--pairs 6] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from bench.common import percentile, stream_completion, write_results  # noqa: E402
from shared import aio  # noqa: E402
from shared.localstack import LocalStack  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

CONCURRENCY = 32
MAX_TOKENS = 128
SCHEMA = {"type": "object", "required": ["records"], "properties": {"records": {
    "type": "array", "minItems": 40, "items": {
        "type": "object", "required": ["id", "ok", "name"], "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
            "name": {"type": "string", "maxLength": 6}}}}}}
STRUCTURED = {"response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA,
                                                                        "strict": True}}}


def prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(64)] for _ in range(n)]


async def burst(http, stack, batch: list[list[int]], extra: dict | None) -> tuple[float, int, list[float]]:
    """One round of concurrent requests: (seconds, completion tokens, TTFTs)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_completion(http, stack, p, MAX_TOKENS, extra) for p in batch))
    elapsed = time.perf_counter() - start
    return elapsed, sum(final["usage"]["completion_tokens"] for _, final in results), [t for t, _ in results]


def mask_step_ms(model_dir: Path, steps: int = MAX_TOKENS) -> float:
    """The structured-output work of one engine step with CONCURRENCY structured rows, alone:
    fill the bitmasks, mask the logits, advance each matcher (by its masked argmax, which is
    not timed: the sampler does that either way)."""
    import torch

    from services.engine.llm_engine import load_tokenizer
    from services.engine.model_config import ModelConfig
    from services.engine.structured import StructuredOutputs, advance, apply_masks
    from shared.protocol import StructuredSpec

    config = ModelConfig.load(model_dir)
    so = StructuredOutputs(load_tokenizer(model_dir), config.vocab_size, config.eos_token_ids)
    spec = StructuredSpec(json=json.dumps(SCHEMA))

    class Row:
        request_id = "bench"

        def __init__(self):
            self.grammar = so.matcher(spec)

    rows = [Row() for _ in range(CONCURRENCY)]
    generator = torch.Generator().manual_seed(0)
    spent = 0.0
    for _ in range(steps):
        logits = torch.randn(CONCURRENCY, config.vocab_size, generator=generator)
        start = time.perf_counter()
        masked = apply_masks(logits, so.prepare_masks(rows, logits.device), config.vocab_size)
        spent += time.perf_counter() - start
        tokens = masked.argmax(dim=-1).tolist()
        start = time.perf_counter()
        for row, token in zip(rows, tokens):
            advance(row, token)
        spent += time.perf_counter() - start
    return spent / steps * 1e3


async def main_async(args) -> dict:
    model_dir = Path(args.model) if args.model else ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ps = prompts(CONCURRENCY * args.pairs * 2 + 4, args.seed, vocab)
    engine_flags = ["--max-num-seqs", "64", "--num-kv-blocks", "4096", "--log-level", "warning"]
    arms = {"unconstrained": {"seconds": 0.0, "tokens": 0, "ttfts": []},
            "json_schema": {"seconds": 0.0, "tokens": 0, "ttfts": []}}
    with LocalStack(str(model_dir), engines=1, engine_args=engine_flags,
                    gateway_args=["--log-level", "warning"]) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            await stream_completion(http, stack, ps[0], 8)  # warm-up
            start = time.perf_counter()
            cold_ttft, _ = await stream_completion(http, stack, ps[1], 8, STRUCTURED)  # compiles the schema
            cold_s = time.perf_counter() - start
            warm_ttft, _ = await stream_completion(http, stack, ps[2], 8, STRUCTURED)
            await burst(http, stack, ps[-CONCURRENCY:], None)  # the engine at full batch once before measuring
            offset, pair_ratios = 4, []
            for r in range(args.pairs):
                rates = {}
                for name in (("unconstrained", "json_schema") if r % 2 == 0 else ("json_schema", "unconstrained")):
                    batch = ps[offset:offset + CONCURRENCY]
                    offset += CONCURRENCY
                    seconds, tokens, ttfts = await burst(http, stack, batch, STRUCTURED if name == "json_schema" else None)
                    arm = arms[name]
                    arm["seconds"] += seconds
                    arm["tokens"] += tokens
                    arm["ttfts"] += ttfts
                    rates[name] = tokens / seconds
                pair_ratios.append(rates["json_schema"] / rates["unconstrained"])
                print(f"pair {r}: unconstrained {rates['unconstrained']:6.0f} tok/s, json_schema "
                      f"{rates['json_schema']:6.0f} tok/s, ratio {pair_ratios[-1]:.3f}", flush=True)
    out = {}
    for name, arm in arms.items():
        out[name] = {"tokens_per_s": arm["tokens"] / arm["seconds"], "tokens": arm["tokens"],
                     "ttft_p50_ms": percentile(arm["ttfts"], 0.5) * 1e3}
        print(f"{name:>13}: {out[name]['tokens_per_s']:8.0f} tok/s  TTFT p50 {out[name]['ttft_p50_ms']:.1f} ms")
    mask_ms = mask_step_ms(model_dir)
    print(f"token masks in-process: {mask_ms:.3f} ms per step for {CONCURRENCY} structured rows "
          f"(fill the bitmasks, apply them, advance the matchers)")
    overall = out["json_schema"]["tokens_per_s"] / out["unconstrained"]["tokens_per_s"]
    ratio = statistics.median(pair_ratios)
    print(f"json_schema / unconstrained throughput: median of {len(pair_ratios)} pairs {ratio:.3f} "
          f"(target >= 0.8); all rounds together {overall:.3f}")
    print(f"first request with the schema (compile included): TTFT {cold_ttft * 1e3:.0f} ms, "
          f"{cold_s * 1e3:.0f} ms in all; with the schema cached: TTFT {warm_ttft * 1e3:.0f} ms")
    return {**out, "pair_ratios": pair_ratios,
            "summary": {"throughput_ratio": ratio, "throughput_ratio_all_rounds": overall,
                        "cold_compile_ttft_ms": cold_ttft * 1e3,
                               "cached_ttft_ms": warm_ttft * 1e3,
                               "mask_ms_per_step_32_rows": mask_ms}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured.json"))
    args = parser.parse_args()
    write_results(args.out, args, aio.run(main_async(args)))


if __name__ == "__main__":
    main()
