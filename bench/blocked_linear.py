#!/usr/bin/env python
"""bf16 linear layers on CPU: Strata's blocked kernel (kernels/cpu/blocked_linear.c) beside oneDNN's
packed matmul (what services.engine.linear used before, and what vLLM's CPU backend runs), on the
linear shapes of bench/engine_realistic.py's M and L models.

Kernel: for each shape and row count, both layouts of the same weights, called in turn (rounds
alternate, the best of --rounds counts); enough copies of each weight that every call reads it
from memory, as a decode step does (a model's weights are larger than the L3). GFLOP/s, and at
one row the weight bytes read per second.

Engine (--engine): the model loaded three times in one process: its linears in oneDNN's layout
(the KV cache in huge pages, as the engine runs), in the blocked layout with nothing in huge pages
(weights and KV cache in 4 KB pages), and as the engine runs (both in huge pages, SwiGLU fused
into the gate/up product); a fourth arm runs that last engine with SwiGLU as a separate
element-wise pass. Decode steps at the given batches and one prefill of --prefill-len tokens,
alternating the arms, the median of --repeats. Where this CPU has no AVX512-BF16 the blocked
kernel does not run: the script says so.

    python bench/blocked_linear.py                       # kernel, 2 threads: bench/results/blocked_linear.json/png
    python bench/blocked_linear.py --engine M,L          # and the engine, decode b1/b32 and a 2048-token prefill
    python bench/blocked_linear.py --shapes "" --engine M,L --out bench/results/blocked_linear_engine.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.common import write_results  # noqa: E402
from kernels import cpu as cpu_kernels  # noqa: E402
from kernels.cpu import blocked_linear  # noqa: E402
from services.engine import linear as linear_module  # noqa: E402
from services.engine.model import LAYER_LINEARS  # noqa: E402

# (out, in) of every linear of M (Llama, hidden 512) and L (the Qwen2.5-0.5B shape): qkv, o, gate_up, down, lm_head.
SHAPES = {"M": [(1024, 512), (512, 512), (2816, 512), (512, 1408), (32000, 512)],
          "L": [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)]}
MODEL_DIRS = {"M": "bench-llama-m", "L": "bench-qwen2-l"}


def kernel_point(n: int, k: int, rows: int, rounds: int, budget_bytes: float) -> dict:
    copies = max(2, int(budget_bytes // (n * k * 2)))
    plain = [torch.randn(n, k).bfloat16() for _ in range(copies)]
    layouts = {"onednn": [torch.ops.mkldnn._reorder_linear_weight(w, linear_module.PACK_BATCH_HINT) for w in plain],
               "blocked": [blocked_linear.pack(w) for w in plain]}
    del plain
    x = torch.randn(rows, k).bfloat16()
    calls = {"onednn": lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
             "blocked": lambda w: blocked_linear.linear(x, w)}
    flops = 2 * n * k * rows
    reps = max(1, int(2e9 / (flops * copies) + 0.5)) if rows > 16 else max(1, int(4e8 / (n * k * 2 * copies)))
    best = {}
    for _ in range(rounds):
        for name, weights in layouts.items():
            for w in weights:  # warm: primitives built, pages touched
                calls[name](w)
            start = time.perf_counter()
            for _ in range(reps):
                for w in weights:
                    calls[name](w)
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) / (reps * copies))
    point = {"n": n, "k": k, "rows": rows}
    for name, seconds in best.items():
        point[f"{name}_us"] = seconds * 1e6
        point[f"{name}_gflops"] = flops / seconds / 1e9
    point["blocked_vs_onednn"] = best["onednn"] / best["blocked"]
    return point


def engine_ab(key: str, batches: list[int], prefill_len: int, repeats: int, threads: int) -> dict:
    import os
    import random

    from services.engine import LLM, SamplingParams

    home = Path(os.environ.get("STRATA_HOME", Path.home() / ".strata"))
    model_dir = home / "models" / MODEL_DIRS[key]
    if not model_dir.exists():
        return {"skipped": f"{model_dir} absent (python -m shared.realistic_models {key})"}
    engines = {}
    real_available, real_huge = blocked_linear.available, cpu_kernels.huge_page_empty
    small_pages = lambda shape, dtype: torch.empty(shape, dtype=dtype)  # noqa: E731
    # The engine as it runs (KV cache in huge pages) with oneDNN's layout; the blocked kernel
    # with nothing in huge pages; and as it runs.
    for name, available, huge in (("onednn", lambda: False, real_huge), ("blocked_4k", real_available, small_pages),
                                  ("blocked", real_available, real_huge)):
        blocked_linear.available, cpu_kernels.huge_page_empty = available, huge
        try:
            engines[name] = LLM(str(model_dir), dtype="bfloat16", num_threads=threads, max_num_seqs=max(batches),
                                max_num_batched_tokens=max(2048, prefill_len), max_model_len=prefill_len + 64,
                                enable_prefix_caching=False, num_kv_blocks=max(batches) * 24 + prefill_len // 16 + 8)
        finally:
            blocked_linear.available, cpu_kernels.huge_page_empty = real_available, real_huge
        model = engines[name].engine.runner.model
        layouts = {model.lm_head.layout} | {getattr(model.layers[0], n).layout for n in LAYER_LINEARS}
        print(f"  {key} {name}: linears held {'/'.join(sorted(layouts))}", flush=True)
    vocab = engines["blocked"].engine.runner.model.lm_head.out_features
    rng = random.Random(0)
    result = {}
    # (arm, engine, whether its gate/up linears fuse SwiGLU)
    arms = [("onednn", engines["onednn"], False), ("blocked_4k", engines["blocked_4k"], True),
            ("blocked", engines["blocked"], True), ("blocked_swiglu_apart", engines["blocked"], False)]

    def set_swiglu(llm, fused: bool) -> None:
        for layer in llm.engine.runner.model.layers:
            if layer.gate_up.layout == "blocked":
                layer.gate_up.fuses_swiglu = fused

    def timed(llm, prompts, max_tokens):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        return time.perf_counter() - start

    points = [(f"decode b{b}", [[rng.randrange(100, vocab - 100) for _ in range(64)] for _ in range(b)], 17)
              for b in batches]
    points.append((f"prefill {prefill_len}", [[rng.randrange(100, vocab - 100) for _ in range(prefill_len)]], 1))
    for label, prompts, max_tokens in points:
        seconds = {name: [] for name, _, _ in arms}
        for _ in range(repeats):
            for name, llm, fused in arms:
                set_swiglu(llm, fused)
                full = timed(llm, prompts, max_tokens)
                seconds[name].append(full - timed(llm, prompts, 1) if max_tokens > 1 else full)
        set_swiglu(engines["blocked"], True)
        median = {name: statistics.median(v) for name, v in seconds.items()}
        tokens = len(prompts) * (max_tokens - 1) if max_tokens > 1 else prefill_len
        result[label] = {**{f"{name}_tokens_per_s": tokens / s for name, s in median.items()},
                         "blocked_vs_onednn": median["onednn"] / median["blocked"],
                         "huge_pages_vs_4k": median["blocked_4k"] / median["blocked"],
                         "swiglu_fused_vs_apart": median["blocked_swiglu_apart"] / median["blocked"]}
        print(f"  {key} {label:14s} " + "  ".join(f"{name} {tokens / s:8.1f}" for name, s in median.items())
              + f" tok/s  blocked/onednn x{median['onednn'] / median['blocked']:.2f}  huge pages/4 KB "
              f"x{median['blocked_4k'] / median['blocked']:.2f}  SwiGLU fused/apart "
              f"x{median['blocked_swiglu_apart'] / median['blocked']:.2f}", flush=True)
    return result


def plot(points: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(p["n"], p["k"]) for p in points}, key=lambda s: (s[1], s[0]))
    cols = 5
    fig, axes = plt.subplots(-(-len(shapes) // cols), cols, figsize=(4 * cols, 3.4 * -(-len(shapes) // cols)),
                             squeeze=False)
    for ax, (n, k) in zip(axes.flat, shapes):
        pts = sorted((p for p in points if (p["n"], p["k"]) == (n, k)), key=lambda p: p["rows"])
        rows = [p["rows"] for p in pts]
        for name in ("onednn", "blocked"):
            ax.plot(rows, [p[f"{name}_gflops"] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{n} x {k}")
        ax.set_xlabel("rows")
        ax.set_ylabel("GFLOP/s")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    fig.suptitle("bf16 linear on CPU: blocked kernel vs oneDNN packed (rows = tokens in the step)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="M,L", help="models whose linear shapes to run: M,L")
    parser.add_argument("--rows", default="1,4,16,32,64,256,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weight-mib", type=float, default=96, help="weight copies per point (MiB): past the L3")
    parser.add_argument("--engine", default="", help="also the engine A/B on these models (M,L)")
    parser.add_argument("--engine-batches", default="1,32")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "blocked_linear.json"))
    parser.add_argument("--png", default=str(HERE / "results" / "blocked_linear.png"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not blocked_linear.available():
        print("this CPU has no AVX512-BF16 (or no C compiler): the blocked kernel does not run here; "
              "bf16 weights stay in oneDNN's layout")
        return
    points = []
    for key in filter(None, args.shapes.split(",")):  # --shapes "": the engine A/B alone
        for n, k in SHAPES[key]:
            for rows in map(int, args.rows.split(",")):
                p = kernel_point(n, k, rows, args.rounds, args.weight_mib * 2**20)
                points.append({"model": key, **p})
                extra = f"  {n * k * 2 / p['blocked_us'] / 1e3:5.1f} GB/s of weight" if rows == 1 else ""
                print(f"{key} {n:6d}x{k:4d} rows {rows:4d}: onednn {p['onednn_gflops']:6.1f}  blocked "
                      f"{p['blocked_gflops']:6.1f} GFLOP/s  x{p['blocked_vs_onednn']:.2f}{extra}", flush=True)
    engine = {key: engine_ab(key, [int(b) for b in args.engine_batches.split(",")], args.prefill_len, args.repeats,
                             args.threads)
              for key in filter(None, args.engine.split(","))}
    write_results(args.out, args, {"kernel": points, "engine": engine})
    if points:
        plot(points, Path(args.png))


if __name__ == "__main__":
    main()
