#!/usr/bin/env python
"""bf16 linear layers on CPU: Strata's blocked kernel (kernels/cpu/blocked_linear.c) beside oneDNN's
packed matmul (what services.engine.linear used before, and what vLLM's CPU backend runs), on the
linear shapes of bench/engine_realistic.py's M and L models.

--fp32: the same for an fp32 model of bf16 weights (a bf16 checkpoint run in fp32, as on CPUs
without bf16 instructions): the kernel's fp32 path (fp32 activations, the weights' bf16 values
blocked; AVX2 and FMA) beside oneDNN's fp32 packed matmul; and the engine (--engine) in fp32
with its linears in oneDNN's layout alone, and as it runs (on an AVX2 CPU without AVX-512, layout
"blocked": every call on the bf16 values; with AVX-512, "onednn+blocked": calls of up to
linear.SMALL_CALL_ROWS rows on the bf16 copy).

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
kernel does not run: the script says so. Where it has AMX (`kernels.cpu.amx()`), the blocked
weights run on AMX's tiles, and once more on AVX512-BF16's vector tiles: a third kernel arm
("amx" beside "blocked", the vector tiles) and a fifth engine arm ("blocked_vector_tiles", the
as-run engine with `kernels.cpu.use_amx(False)`, which turns prefill attention's tiles off too).

    python bench/blocked_linear.py                       # kernel, 2 threads: bench/results/blocked_linear.json/png
    python bench/blocked_linear.py --engine M,L          # and the engine, decode b1/b32 and a 2048-token prefill
    python bench/blocked_linear.py --shapes "" --engine M,L --out bench/results/blocked_linear_engine.json
    python bench/blocked_linear.py --fp32 --engine M,L --engine-batches 1,4,16,32 --prefill-len 512
                                                         # bench/results/blocked_linear_fp32.json/png
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


def kernel_point(n: int, k: int, rows: int, rounds: int, budget_bytes: float, fp32: bool = False) -> dict:
    """fp32: fp32 activations, oneDNN's layout of the fp32 weight against the blocked bf16 values."""
    dtype = torch.float32 if fp32 else torch.bfloat16
    copies = max(2, int(budget_bytes // (n * k * 2)))
    plain = [torch.randn(n, k).bfloat16() for _ in range(copies)]
    layouts = {"onednn": [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), linear_module.PACK_BATCH_HINT)
                          for w in plain],
               "blocked": [blocked_linear.pack(w) for w in plain]}
    del plain
    x = torch.randn(rows, k, dtype=dtype)
    calls = {"onednn": lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
             "blocked": lambda w: blocked_linear.linear(x, w)}
    # With AMX, the blocked weights run twice: on AVX512-BF16's vector tiles ("blocked") and on AMX's
    amx = not fp32 and cpu_kernels.use_amx(True)
    if amx:
        layouts["amx"], calls["amx"] = layouts["blocked"], calls["blocked"]
    flops = 2 * n * k * rows
    reps = max(1, int(2e9 / (flops * copies) + 0.5)) if rows > 16 else max(1, int(4e8 / (n * k * 2 * copies)))
    best = {}
    for _ in range(rounds):
        for name, weights in layouts.items():
            if amx:
                cpu_kernels.use_amx(name == "amx")
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
    if amx:
        cpu_kernels.use_amx(True)
        point["amx_vs_onednn"] = best["onednn"] / best["amx"]
        point["amx_vs_blocked"] = best["blocked"] / best["amx"]
    return point


def engine_ab_fp32(key: str, batches: list[int], prefill_len: int, repeats: int, threads: int) -> dict:
    """The model in fp32 (its bf16 values), linears in oneDNN's layout alone against the engine as
    it runs (its arm named after the layout it holds), alternating; decode steps at `batches` and
    one prefill."""
    model_dir = model_path(key)
    if model_dir is None:
        return {"skipped": f"{key} absent (python -m shared.realistic_models {key})"}
    real = blocked_linear.available_f32
    blocked_linear.available_f32 = lambda: False
    try:
        engines = {"onednn": load_engine(model_dir, "float32", threads, batches, prefill_len)}
    finally:
        blocked_linear.available_f32 = real
    as_run = load_engine(model_dir, "float32", threads, batches, prefill_len)
    held = "/".join(held_layouts(as_run))
    engines[held] = as_run
    for name, llm in engines.items():
        print(f"  {key} {name}: linears held {'/'.join(held_layouts(llm))}", flush=True)
    result = {"held": held}
    for label, prompts, max_tokens in engine_points(engines["onednn"], batches, prefill_len):
        median = alternate(engines, prompts, max_tokens, repeats)
        tokens = len(prompts) * (max_tokens - 1) if max_tokens > 1 else prefill_len
        ratio = median["onednn"] / median[held]
        result[label] = {**{f"{name}_tokens_per_s": tokens / s for name, s in median.items()},
                         "blocked_vs_onednn": ratio}
        print(f"  {key} {label:14s} " + "  ".join(f"{name} {tokens / s:8.1f}" for name, s in median.items())
              + f" tok/s  {held}/onednn x{ratio:.2f}", flush=True)
    return result


def load_engine(model_dir: Path, dtype: str, threads: int, batches: list[int], prefill_len: int):
    """The offline engine, sized for the A/B's decode batches and its prefill."""
    from services.engine import LLM

    return LLM(str(model_dir), dtype=dtype, num_threads=threads, max_num_seqs=max(batches),
               max_num_batched_tokens=max(2048, prefill_len), max_model_len=prefill_len + 64,
               enable_prefix_caching=False, num_kv_blocks=max(batches) * 24 + prefill_len // 16 + 8)


def model_path(key: str) -> Path | None:
    import os

    model_dir = Path(os.environ.get("STRATA_HOME", Path.home() / ".strata")) / "models" / MODEL_DIRS[key]
    return model_dir if model_dir.exists() else None


def held_layouts(llm) -> list[str]:
    model = llm.engine.runner.model
    return sorted({model.lm_head.layout} | {getattr(model.layers[0], n).layout for n in LAYER_LINEARS})


def engine_points(llm, batches: list[int], prefill_len: int) -> list[tuple[str, list, int]]:
    """(label, prompts, max_tokens): decode at each batch (17 tokens after a 64-token prompt), and
    one prefill of prefill_len tokens."""
    import random

    vocab = llm.engine.runner.model.lm_head.out_features
    rng = random.Random(0)
    points = [(f"decode b{b}", [[rng.randrange(100, vocab - 100) for _ in range(64)] for _ in range(b)], 17)
              for b in batches]
    points.append((f"prefill {prefill_len}", [[rng.randrange(100, vocab - 100) for _ in range(prefill_len)]], 1))
    return points


def timed(llm, prompts, max_tokens) -> float:
    from services.engine import SamplingParams

    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    return time.perf_counter() - start


def alternate(arms: dict, prompts, max_tokens: int, repeats: int, before=lambda name: None) -> dict:
    """The median seconds of each arm (name -> LLM), run in turn `repeats` times; decode points
    less the same prompts' one-token run (their prefill)."""
    seconds = {name: [] for name in arms}
    for _ in range(repeats):
        for name, llm in arms.items():
            before(name)
            full = timed(llm, prompts, max_tokens)
            seconds[name].append(full - timed(llm, prompts, 1) if max_tokens > 1 else full)
    return {name: statistics.median(v) for name, v in seconds.items()}


def engine_ab(key: str, batches: list[int], prefill_len: int, repeats: int, threads: int) -> dict:
    model_dir = model_path(key)
    if model_dir is None:
        return {"skipped": f"{key} absent (python -m shared.realistic_models {key})"}
    engines = {}
    real_available, real_huge = blocked_linear.available, cpu_kernels.huge_page_empty
    small_pages = lambda shape, dtype: torch.empty(shape, dtype=dtype)  # noqa: E731
    # The engine as it runs (KV cache in huge pages) with oneDNN's layout; the blocked kernel
    # with nothing in huge pages; and as it runs.
    for name, available, huge in (("onednn", lambda: False, real_huge), ("blocked_4k", real_available, small_pages),
                                  ("blocked", real_available, real_huge)):
        blocked_linear.available, cpu_kernels.huge_page_empty = available, huge
        try:
            engines[name] = load_engine(model_dir, "bfloat16", threads, batches, prefill_len)
        finally:
            blocked_linear.available, cpu_kernels.huge_page_empty = real_available, real_huge
        print(f"  {key} {name}: linears held {'/'.join(held_layouts(engines[name]))}", flush=True)
    result = {}
    # the blocked engine again with its gate/up linears' SwiGLU apart; with AMX, once more on
    # AVX512-BF16's vector tiles
    amx = cpu_kernels.amx()
    arms = {**engines, "blocked_swiglu_apart": engines["blocked"]}
    if amx:
        arms["blocked_vector_tiles"] = engines["blocked"]

    def before(name: str) -> None:
        for layer in engines["blocked"].engine.runner.model.layers:
            if layer.gate_up.layout == "blocked":
                layer.gate_up.fuses_swiglu = name != "blocked_swiglu_apart"
        if amx:
            cpu_kernels.use_amx(name != "blocked_vector_tiles")

    for label, prompts, max_tokens in engine_points(engines["blocked"], batches, prefill_len):
        median = alternate(arms, prompts, max_tokens, repeats, before=before)
        before("blocked")
        tokens = len(prompts) * (max_tokens - 1) if max_tokens > 1 else prefill_len
        ratios = {"blocked_vs_onednn": median["onednn"] / median["blocked"],
                  "huge_pages_vs_4k": median["blocked_4k"] / median["blocked"],
                  "swiglu_fused_vs_apart": median["blocked_swiglu_apart"] / median["blocked"]}
        if amx:
            ratios["amx_vs_vector_tiles"] = median["blocked_vector_tiles"] / median["blocked"]
        result[label] = {**{f"{name}_tokens_per_s": tokens / s for name, s in median.items()}, **ratios}
        print(f"  {key} {label:14s} " + "  ".join(f"{name} {tokens / s:8.1f}" for name, s in median.items())
              + " tok/s  " + "  ".join(f"{name} x{r:.2f}" for name, r in ratios.items()), flush=True)
    return result


def plot(points: list[dict], path: Path, fp32: bool) -> None:
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
        for name in [n for n in ("onednn", "blocked", "amx") if f"{n}_gflops" in pts[0]]:
            ax.plot(rows, [p[f"{name}_gflops"] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{n} x {k}")
        ax.set_xlabel("rows")
        ax.set_ylabel("GFLOP/s")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    fig.suptitle("fp32 linear on CPU over bf16 weight values: blocked kernel (bf16 copy) vs oneDNN packed fp32"
                 if fp32 else "bf16 linear on CPU: blocked kernel vs oneDNN packed (rows = tokens in the step)")
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
    parser.add_argument("--fp32", action="store_true",
                        help="fp32 activations over the weights' bf16 values (the kernel's AVX2 path)")
    parser.add_argument("--out", help="default bench/results/blocked_linear.json (--fp32: blocked_linear_fp32.json)")
    parser.add_argument("--png", help="default beside --out")
    args = parser.parse_args()
    args.out = args.out or str(HERE / "results" / f"blocked_linear{'_fp32' if args.fp32 else ''}.json")
    args.png = args.png or str(Path(args.out).with_suffix(".png"))
    torch.set_num_threads(args.threads)
    if not (blocked_linear.available_f32() if args.fp32 else blocked_linear.available()):
        print(f"this CPU has no {'AVX2 and FMA' if args.fp32 else 'AVX512-BF16'} (or no C compiler): the blocked "
              "kernel does not run here; the weights stay in oneDNN's layout")
        return
    points = []
    for key in filter(None, args.shapes.split(",")):  # --shapes "": the engine A/B alone
        for n, k in SHAPES[key]:
            for rows in map(int, args.rows.split(",")):
                p = kernel_point(n, k, rows, args.rounds, args.weight_mib * 2**20, args.fp32)
                points.append({"model": key, **p})
                extra = f"  {n * k * 2 / p['blocked_us'] / 1e3:5.1f} GB/s of weight" if rows == 1 else ""
                amx = (f"  amx {p['amx_gflops']:6.1f} (x{p['amx_vs_onednn']:.2f} onednn, x{p['amx_vs_blocked']:.2f} "
                       "blocked)") if "amx_gflops" in p else ""
                print(f"{key} {n:6d}x{k:4d} rows {rows:4d}: onednn {p['onednn_gflops']:6.1f}  blocked "
                      f"{p['blocked_gflops']:6.1f} GFLOP/s  x{p['blocked_vs_onednn']:.2f}{amx}{extra}", flush=True)
    run_engine = engine_ab_fp32 if args.fp32 else engine_ab
    engine = {key: run_engine(key, [int(b) for b in args.engine_batches.split(",")], args.prefill_len, args.repeats,
                             args.threads)
              for key in filter(None, args.engine.split(","))}
    write_results(args.out, args, {"kernel": points, "engine": engine})
    if points:
        plot(points, Path(args.png), args.fp32)


if __name__ == "__main__":
    main()
