#!/usr/bin/env python
"""CPU prefill attention: the C kernel (kernels/cpu/prefill_attention.c) vs torch's SDPA, as
TorchAttention._prefill runs them (the same call with the kernels on and off), per layer.

One sequence with no cached prefix, bf16 (or fp32: --dtype), block_size 16 with the blocks scattered over the
cache, at the M shape (Llama: 8 heads / 4 KV heads, head_dim 64), the L shape (Qwen2.5-0.5B: 14
/ 2, head_dim 64) and 16 / 2 at head_dim 128, prompts of 128 to 4096 tokens. Prints ms per layer
(best of at least --repeats calls after a warm-up, more for short calls: the machine may be
shared; medians are recorded too) and the
speed-up of the best times; writes bench/results/prefill_attention.json.

    python bench/prefill_attention.py                 # 2 threads
    python bench/prefill_attention.py --threads 1 --lengths 512 2048
    python bench/prefill_attention.py --dtype fp32    # as an fp32 model runs (an AVX2-only CPU's dtype=auto)
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
from services.engine.attention import AttentionMetadata, TorchAttention  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = {"M (8/4, d64)": (8, 4, 64), "L (14/2, d64)": (14, 2, 64), "16/2, d128": (16, 2, 128)}
BLOCK = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--out", default=str(HERE / "results" / "prefill_attention.json"))
    return p.parse_args(argv)


def setup(heads: int, kv_heads: int, head_dim: int, length: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    blocks = -(-length // BLOCK)
    num_blocks = blocks + 8
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_blocks, generator=g)[:blocks].to(torch.int32)[None]
    # q, k, v as views into one fused projection, as the model passes them.
    qkv = torch.randn(length, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, :heads * head_dim].view(length, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(length, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(length, kv_heads, head_dim)
    pos = torch.arange(length)
    slots = (table[0].long()[pos // BLOCK] * BLOCK + pos % BLOCK)
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(slots, 0, empty.view(0, 0), empty, length, table,
                             torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                             [length], [length])
    attn = TorchAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    attn._store(k, v, k_cache, v_cache, meta)
    return attn, (q, k, v, k_cache, v_cache, meta)


def time_ms(fn, repeats: int) -> tuple[float, float]:
    """(best, median) milliseconds of `repeats` calls after a warm-up."""
    fn()  # warm-up (and the kernel build)
    samples, start = [], time.perf_counter()
    # At least `repeats` calls and about half a second of them (at most 50): on a shared machine
    # the best of a few short calls is often one that was preempted.
    while len(samples) < repeats or (time.perf_counter() - start < 0.5 and len(samples) < 50):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples), statistics.median(samples)


def main(argv=None) -> None:
    args = parse_args(argv)
    if cpu_kernels.load() is None:
        sys.exit("CPU kernels unavailable (no C compiler)")
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'shape':<16}{'tokens':>8}{'SDPA ms':>10}{'kernel ms':>11}{'speed-up':>10}")
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for length in args.lengths:
            attn, (q, k, v, kc, vc, meta) = setup(heads, kv_heads, head_dim, length, DTYPES[args.dtype])
            out = torch.empty_like(q)
            times, medians = {}, {}
            for label, on in (("sdpa", False), ("kernel", True)):
                attn.prefill_kernel = on  # on any CPU: also where the engine takes SDPA
                times[label], medians[label] = time_ms(lambda: attn._prefill(q, k, v, kc, vc, meta, out),
                                                       args.repeats)
            # The two paths agree (bf16 rounding apart): a benchmark of a wrong kernel is no benchmark.
            attn.prefill_kernel = False
            ref = torch.empty_like(q)
            attn._prefill(q, k, v, kc, vc, meta, ref)
            err = (out.float() - ref.float()).abs().max().item()
            speedup = times["sdpa"] / times["kernel"]
            rows.append(dict(shape=name, heads=heads, kv_heads=kv_heads, head_dim=head_dim, tokens=length,
                             sdpa_ms=round(times["sdpa"], 3), kernel_ms=round(times["kernel"], 3),
                             speedup=round(speedup, 2), sdpa_median_ms=round(medians["sdpa"], 3),
                             kernel_median_ms=round(medians["kernel"], 3), max_abs_diff=err))
            print(f"{name:<16}{length:>8}{times['sdpa']:>10.2f}{times['kernel']:>11.2f}{speedup:>9.2f}x"
                  f"   (max |diff| {err:.3g})")
    write_results(args.out, args, {"dtype": args.dtype, "block_size": BLOCK, "results": rows})


if __name__ == "__main__":
    main()
