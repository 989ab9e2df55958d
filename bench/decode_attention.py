#!/usr/bin/env python
"""CPU decode attention (kernels/cpu/paged_attention.c) as a decode step meets it: one call per
layer over that layer's own K/V cache, so each layer's blocks come from memory, not from a cache
the previous call warmed (8 layers of M b32 at 145 tokens are 36 MB of bf16 KV; the L3 is 32 MB).

Shapes (heads / KV heads, head_dim 64, bf16 or --dtype fp32, block_size 16, every sequence's
blocks scattered over the cache, in huge pages as the engine's are): M (8/4) and L (14/2,
Qwen2.5-0.5B's group of 7) at the batches and contexts of
bench/engine_realistic.py's decode points and longer. For each: microseconds per layer (median of
--repeats passes over the layers), the KV bytes read per second, and the floor: a plain C pass
that only reads the same blocks (the kernel built beside the engine's, with the same flags). The
kernel's output is checked against the reference on the first layer.

    python bench/decode_attention.py                # 2 threads, writes bench/results/decode_attention.json
    python bench/decode_attention.py --threads 1 --cases 32x145 64x300
    python bench/decode_attention.py --dtype fp32   # the caches --dtype auto gives a CPU without bf16

--baseline REV also builds the kernel as it was at git revision REV (same flags) and times it and
this tree's build in turn, pass by pass, both called straight through ctypes, so that the machine's
noise and the call's cost fall on both alike: their microseconds, the speed-up (baseline / this
build) and whether both give the same bits.

    python bench/decode_attention.py --dtype fp32 --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.common import resolve_revision, revision_kernel_sources, write_results  # noqa: E402
from kernels import cpu as cpu_kernels  # noqa: E402
from kernels.reference import paged_decode_attention_ref  # noqa: E402

SHAPES = {"M": (8, 4), "L": (14, 2)}
HEAD_DIM, BLOCK = 64, 16
# batch x context: the bench's decode points (prompts of 128 at M, 64 at L, plus what they decode) and longer.
DEFAULT_CASES = ["1x145", "4x145", "32x145", "64x145", "32x600", "1x1000"]

# Reads every K and V block of every sequence once (the data a decode call must move), summing
# 64-bit lanes so nothing is optimised away, and fetching the block two ahead into L2 as it goes
# (as the kernel does: scattered blocks defeat the hardware prefetchers): what memory alone
# costs for this access pattern.
STREAM_C = r"""
#include <stdint.h>
long strata_stream_blocks(const char *k, const char *v, const int32_t *tables, int batch, int blocks,
                          long block_bytes, int threads) {
    long total = 0;
    #pragma omp parallel for reduction(+:total) schedule(dynamic, 1) num_threads(threads)
    for (int b = 0; b < batch; b++)
        for (int pass = 0; pass < 2; pass++) {
            const char *c = pass ? v : k;
            for (int i = 0; i < blocks; i++) {
                const uint64_t *p = (const uint64_t *)(c + (long)tables[b * blocks + i] * block_bytes);
                const char *ahead =
                    i + 2 < blocks ? c + (long)tables[b * blocks + i + 2] * block_bytes : 0;
                uint64_t s = 0;
                for (long line = 0; line < block_bytes / 64; line++) {
                    if (ahead) __builtin_prefetch(ahead + line * 64, 0, 2);
                    for (int j = 0; j < 8; j++) s += p[line * 8 + j];
                }
                total += (long)s;
            }
        }
    return total;
}
"""


def c_function(lib: ctypes.CDLL, dtype: torch.dtype):
    """The decode kernel's C function for `dtype` in a build of paged_attention.c, declared."""
    fn = getattr(lib, f"strata_paged_decode_attention_{cpu_kernels.KERNEL_DTYPES[dtype]}")
    fn.restype, fn.argtypes = ctypes.c_int, list(cpu_kernels.DECODE_ATTENTION_ARGTYPES)
    return fn


def baseline_kernel(rev: str, dtype: torch.dtype):
    """The decode kernel's C function as built from git revision `rev` (paged_attention.c and its
    headers), with the flags the engine's build uses."""
    tmp = revision_kernel_sources(rev, ("paged_attention.c", *cpu_kernels.HEADERS))
    subprocess.run(["gcc", *cpu_kernels.CFLAGS, str(tmp / "paged_attention.c"), "-o", str(tmp / "base.so"), "-lm"],
                   check=True)
    return c_function(ctypes.CDLL(str(tmp / "base.so")), dtype)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=8, help="caches called in turn, one per layer")
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="BATCHxCONTEXT")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="the cache's and the query's dtype (fp32: as --dtype auto runs on a CPU without bf16)")
    p.add_argument("--baseline", metavar="REV", help="also time the kernel of this git revision, in turn")
    p.add_argument("--out", default=str(HERE / "results" / "decode_attention.json"))
    return p.parse_args(argv)


def stream_kernel() -> ctypes.CDLL:
    tmp = Path(tempfile.mkdtemp())
    (tmp / "stream.c").write_text(STREAM_C)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(tmp / "stream.c"),
                    "-o", str(tmp / "stream.so")], check=True)
    lib = ctypes.CDLL(str(tmp / "stream.so"))
    lib.strata_stream_blocks.restype = ctypes.c_long
    lib.strata_stream_blocks.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_long, ctypes.c_int]
    return lib


def per_layer_us(calls: list, layers: int, repeats: int) -> list[float]:
    """Median microseconds per layer of each call, the calls taking turns pass by pass."""
    for call in calls:
        call()  # warm-up
    samples = [[] for _ in calls]
    for _ in range(repeats):
        for call, times in zip(calls, samples):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) / layers * 1e6)
    return [statistics.median(times) for times in samples]


def main(argv=None) -> None:
    args = parse_args(argv)
    if cpu_kernels.load() is None:
        sys.exit("CPU kernels unavailable (no C compiler)")
    torch.set_num_threads(args.threads)
    stream = stream_kernel()
    g = torch.Generator().manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    baseline = this_fn = None
    if args.baseline:
        args.baseline = resolve_revision(args.baseline)
        baseline, this_fn = baseline_kernel(args.baseline, dtype), c_function(cpu_kernels.load(), dtype)
    elem_bytes = dtype.itemsize
    rows = []
    print(f"{'shape':<6}{'batch':>6}{'context':>9}{'kernel us':>11}{'GB/s':>7}{'floor us':>10}{'GB/s':>7}"
          f"{'kernel/floor':>14}" + (f"{'C call us':>10}{'baseline us':>13}{'speed-up':>10}{'same bits':>11}"
                                     if baseline else ""))
    for case in args.cases:
        batch, context = map(int, case.split("x"))
        per_seq = -(-context // BLOCK)
        for name, (heads, kv_heads) in SHAPES.items():
            num_blocks = max(4096, 2 * batch * per_seq)
            shape = (num_blocks, BLOCK, kv_heads, HEAD_DIM)
            # in huge pages, as the engine allocates its caches (services/engine/quantization/kv_cache.py)
            caches = [tuple(cpu_kernels.huge_page_empty(shape, dtype).copy_(torch.randn(shape, generator=g))
                            for _ in "kv") for _ in range(args.layers)]
            tables = torch.randperm(num_blocks, generator=g)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
            lens = torch.full((batch,), context, dtype=torch.int32)
            q = torch.randn(batch, heads, HEAD_DIM, generator=g).to(dtype)
            out = torch.empty_like(q)
            step = cpu_kernels.PagedDecode(tables, lens, HEAD_DIM ** -0.5)
            ref = paged_decode_attention_ref(q.float(), caches[0][0].float(), caches[0][1].float(), tables, lens,
                                             HEAD_DIM ** -0.5)
            step(q, *caches[0], out)
            err = (out.float() - ref).abs().max().item()
            if err > 0.05:
                sys.exit(f"{name} {case}: the kernel is off the reference by {err}")

            def kernel():
                for k_cache, v_cache in caches:
                    step(q, k_cache, v_cache, out)

            def floor():
                for k_cache, v_cache in caches:
                    stream.strata_stream_blocks(k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), batch,
                                                per_seq, BLOCK * kv_heads * HEAD_DIM * elem_bytes, args.threads)

            def c_calls(fn, result, layers=caches):
                """Both builds called the same way for --baseline: straight through ctypes."""
                def run():
                    for k_cache, v_cache in layers:
                        fn(q.data_ptr(), heads * HEAD_DIM, k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                           lens.data_ptr(), result.data_ptr(), heads * HEAD_DIM, batch, heads, kv_heads, HEAD_DIM,
                           BLOCK, per_seq, HEAD_DIM ** -0.5, args.threads, None, None)
                return run

            this_out, base_out = torch.empty_like(q), torch.empty_like(q)
            pair = [c_calls(this_fn, this_out), c_calls(baseline, base_out)] if baseline else []
            kernel_us, floor_us, *pair_us = per_layer_us([kernel, floor] + pair, args.layers, args.repeats)
            kv_bytes = 2 * batch * per_seq * BLOCK * kv_heads * HEAD_DIM * elem_bytes
            row = dict(shape=name, heads=heads, kv_heads=kv_heads, batch=batch, context=context,
                       kernel_us=round(kernel_us, 1), floor_us=round(floor_us, 1),
                       kernel_gb_s=round(kv_bytes / kernel_us / 1e3, 2), floor_gb_s=round(kv_bytes / floor_us / 1e3, 2),
                       max_abs_diff=err)
            line = (f"{name:<6}{batch:>6}{context:>9}{kernel_us:>11.1f}{kv_bytes / kernel_us / 1e3:>7.1f}"
                    f"{floor_us:>10.1f}{kv_bytes / floor_us / 1e3:>7.1f}{kernel_us / floor_us:>13.2f}x")
            if baseline:
                this_us, base_us = pair_us
                c_calls(this_fn, this_out, caches[:1])()
                c_calls(baseline, base_out, caches[:1])()
                same = torch.equal(this_out, base_out)
                row.update(c_call_us=round(this_us, 1), baseline_us=round(base_us, 1), speedup=round(base_us / this_us, 3),
                           same_bits=same)
                line += f"{this_us:>10.1f}{base_us:>13.1f}{base_us / this_us:>9.2f}x{'yes' if same else 'no':>11}"
            rows.append(row)
            print(line)
            del caches
    write_results(args.out, args, {"dtype": args.dtype, "head_dim": HEAD_DIM, "block_size": BLOCK,
                                   "layers": args.layers, "baseline": args.baseline, "results": rows})


if __name__ == "__main__":
    main()
