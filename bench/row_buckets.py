"""Packed CPU matmuls at bucketed row counts (services.engine.linear.row_bucket) vs exact ones.

oneDNN builds a primitive for every matmul shape it meets. Without buckets a continuous batch
meets a new row count at almost every step; with them the model pads a step's rows to one of 55
sizes up to 2048, warmed at load. Each arm is a fresh process (oneDNN's primitive cache is per
process), arms interleaved, prefix caching off: a batch of 48 requests with prompts of 16-300
tokens and 8-64 output tokens each, greedy, run twice (the first run is what a new server
meets). Prints tokens/s per arm and the ratio; writes bench/results/row_buckets.json.

    python bench/row_buckets.py [--shape M] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_results  # noqa: E402

ARMS = ("buckets", "exact")


def arm(model: str, buckets: bool, threads: int) -> dict:
    """One arm in this process: load, then the batch twice; tokens/s of each run."""
    from services.engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", num_threads=threads, max_num_seqs=64, max_model_len=768,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    llm.engine.runner.model.pads_rows = buckets
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(16, 300))] for _ in range(48)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 64), ignore_eos=True) for _ in prompts]
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        runs.append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    return {"load_s": load_s, "first_tokens_per_s": runs[0], "second_tokens_per_s": runs[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="M", help="a shape of shared.realistic_models (M, L)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench/results/row_buckets.json"))
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process's one arm
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(arm(args.model, args.arm == "buckets", args.threads)))
        return

    from shared.realistic_models import ensure_model

    model = str(ensure_model(args.shape))
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    for r in range(args.repeats):
        for name in ARMS:
            out = subprocess.run([sys.executable, __file__, "--arm", name, "--model", model,
                                  "--threads", str(args.threads)], capture_output=True, text=True, timeout=900,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
            if out.returncode:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(res)
            print(f"[{r + 1}/{args.repeats}] {name:>7}: first run {res['first_tokens_per_s']:7.1f} tok/s, "
                  f"second {res['second_tokens_per_s']:7.1f} (load {res['load_s']:.1f} s)", flush=True)
    summary = {}
    for run in ("first_tokens_per_s", "second_tokens_per_s"):
        medians = {name: statistics.median(r[run] for r in runs[name]) for name in ARMS}
        summary[run] = {**medians, "ratio": medians["buckets"] / medians["exact"]}
        print(f"{run.split('_')[0]} run: buckets {medians['buckets']:.1f} tok/s, exact {medians['exact']:.1f}, "
              f"{summary[run]['ratio']:.2f}x")
    load = {name: statistics.median(r["load_s"] for r in runs[name]) for name in ARMS}
    print(f"load: buckets {load['buckets']:.1f} s (warm-up included), exact {load['exact']:.1f} s")
    write_results(args.out, args, {"model": model, "runs": runs, "summary": summary, "load_s": load})


if __name__ == "__main__":
    main()
