"""Linear layers on the CPU: torch's own matmul rate on a model's linear shapes vs Strata's.

For each model and batch size, over the shapes of one decoder layer (qkv, o, gate_up, down) plus
the lm_head, in the model's dtype:
  torch         F.linear on plain weights (what torch itself gets on those shapes)
  strata        services.engine.linear.Linear standalone (weights in its CPU layout: the blocked
                bf16 kernel's where the CPU has AVX512-BF16, else oneDNN's packed one)
  engine        the linear layers inside a real decode step of Strata's engine at that batch
                size (wall time inside Linear's calls, timed around each, the fused gate/up
                and SwiGLU call included; FLOPs from the shapes; a profiler's op list would
                miss the blocked bf16 kernel, a ctypes call)
Each at 1 and N threads. Prints GFLOP/s and the ratios to torch; writes bench/results/matmul_rate.json.

    python bench/matmul_rate.py [--models DIR,DIR] [--batches 1,32] [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import write_results  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.linear import Linear  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def linear_shapes(model_dir: Path) -> list[tuple[int, int, int]]:
    """(out, in, count per forward) of the model's linear layers."""
    c = json.loads((model_dir / "config.json").read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads") or heads
    layers = c["num_hidden_layers"]
    return [((heads + 2 * kv) * head_dim, hidden, layers), (hidden, heads * head_dim, layers),
            (2 * c["intermediate_size"], hidden, layers), (hidden, c["intermediate_size"], layers),
            (c["vocab_size"], hidden, 1)]


def best_of(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def standalone(shapes, batch: int, dtype: torch.dtype, reps: int) -> dict:
    """GFLOP/s over one forward's linear layers: torch F.linear vs Strata's Linear."""
    g = torch.Generator().manual_seed(0)
    flops, t_torch, t_strata = 0.0, 0.0, 0.0
    for out_f, in_f, count in shapes:
        w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(dtype)
        x = torch.randn(batch, in_f, generator=g).to(dtype)
        packed = Linear(w)
        t_torch += count * best_of(lambda: F.linear(x, w), reps)
        t_strata += count * best_of(lambda: packed(x), reps)
        flops += count * 2.0 * batch * out_f * in_f
    return {"torch_gflops": flops / t_torch / 1e9, "strata_gflops": flops / t_strata / 1e9}


def in_engine(model_dir: Path, shapes, batch: int, dtype: str, steps: int) -> dict:
    """The linear layers' rate inside decode steps of the real engine."""
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=batch, num_kv_blocks=max(64, batch * 16),
              num_threads=torch.get_num_threads())
    engine = llm.engine
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(10, vocab) for _ in range(64)],
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):  # prefill and warm-up decodes
        engine.step()
    linear_s, call, swiglu = 0.0, Linear.__call__, Linear.swiglu

    def timed(method):
        def run(self, x):
            nonlocal linear_s
            t = time.perf_counter()
            out = method(self, x)
            linear_s += time.perf_counter() - t
            return out
        return run

    # The gate/up product runs through Linear.swiglu where SwiGLU is fused into it (its time then
    # includes the activation, a small part of it).
    Linear.__call__, Linear.swiglu = timed(call), timed(swiglu)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    finally:
        Linear.__call__, Linear.swiglu = call, swiglu
    flops = steps * sum(count * 2.0 * batch * o * i for o, i, count in shapes)
    return {"engine_gflops": flops / linear_s / 1e9, "linear_share_of_step": linear_s / wall,
            "step_ms": wall / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    home = Path.home() / ".strata" / "models"
    parser.add_argument("--models", default=f"{home / 'bench-llama-m'},{home / 'bench-qwen2-l'}")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=2, help="the multi-thread count (1 is always measured)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "matmul_rate.json"))
    args = parser.parse_args()

    results = []
    for model in args.models.split(","):
        model_dir = Path(model).expanduser()
        shapes = linear_shapes(model_dir)
        for threads in sorted({1, args.threads}):
            torch.set_num_threads(threads)
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"model": model_dir.name, "threads": threads, "batch": batch,
                       **standalone(shapes, batch, DTYPES[args.dtype], args.reps),
                       **in_engine(model_dir, shapes, batch, args.dtype, args.steps)}
                row["strata_vs_torch"] = row["strata_gflops"] / row["torch_gflops"]
                row["engine_vs_torch"] = row["engine_gflops"] / row["torch_gflops"]
                results.append(row)
                print(f"{row['model']:16s} threads {threads} batch {batch:3d}: torch {row['torch_gflops']:6.1f}  "
                      f"strata {row['strata_gflops']:6.1f}  in the engine {row['engine_gflops']:6.1f} GFLOP/s "
                      f"({row['engine_vs_torch']:.2f}x torch; linear {row['linear_share_of_step']:.0%} of a "
                      f"{row['step_ms']:.1f} ms step)", flush=True)
    for model in dict.fromkeys(r["model"] for r in results):
        for batch in dict.fromkeys(r["batch"] for r in results):
            one = next(r for r in results if (r["model"], r["batch"], r["threads"]) == (model, batch, 1))
            many = next(r for r in results if (r["model"], r["batch"], r["threads"]) == (model, batch, args.threads))
            print(f"{model:16s} batch {batch:3d}: {args.threads} threads vs 1 in the engine "
                  f"{many['engine_gflops'] / one['engine_gflops']:.2f}x, torch {many['torch_gflops'] / one['torch_gflops']:.2f}x")
    write_results(args.out, args, {"results": results})


if __name__ == "__main__":
    main()
