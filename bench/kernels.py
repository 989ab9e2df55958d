#!/usr/bin/env python
"""GPU benchmark of Strata's Triton kernels (CUDA only).

(a) Decode attention bandwidth: bytes of KV read per second by
    ``kernels.paged_decode_attention`` vs the device's peak HBM bandwidth, bf16,
    8 KV heads, GQA 4 (32 query heads), head_dim 128, block_size 16, blocks of
    each sequence scattered over the cache, for batch in 1,4,16,64,256 and
    context in 512,2048,8192,32768 (combos over ``--mem-budget-gb`` skipped).
(b) Decode step of a ~1B-parameter Llama-shaped model with random bf16 weights
    (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab
    32000), built here from the kernels plus torch matmuls (not the engine),
    context 512, eager and as a captured CUDA graph, vs the roofline
    ``(weight bytes + KV bytes read) / peak bandwidth``.

Prints tables and writes ``bench/results/kernels.json``.

    python bench/kernels.py            # full sweep (< 3 min on an H200)
    python bench/kernels.py --quick    # smaller sweep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = HERE / "results" / "kernels.json"

# Peak HBM bandwidth, GB/s (1e9 bytes/s), by device-name substrings (all must match).
PEAK_GBPS_TABLE = [
    (("H200",), 4800.0),
    (("H100", "HBM3"), 3350.0),  # H100 SXM5 reports "NVIDIA H100 80GB HBM3"
    (("H100", "SXM"), 3350.0),
    (("A100", "80GB"), 2039.0),  # SXM4 80GB (the PCIe card is 1935; pass --peak-gbps)
]
FALLBACK_PEAK_GBPS = 4800.0

ATTN_BATCHES = [1, 4, 16, 64, 256]
ATTN_CONTEXTS = [512, 2048, 8192, 32768]
ATTN_BATCHES_QUICK = [1, 16, 64]
ATTN_CONTEXTS_QUICK = [512, 8192]
MODEL_BATCHES = [1, 4, 16, 64]
MODEL_BATCHES_QUICK = [1, 16]

ATTN_KV_HEADS, ATTN_GROUP, ATTN_HEAD_DIM, BLOCK_SIZE = 8, 4, 128, 16

MODEL = dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000,
             rope_base=500000.0, eps=1e-5, context=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="peak HBM bandwidth in GB/s; default: from the device name "
                        "(H200 4800, H100 SXM 3350, A100 80GB 2039), else %g" % FALLBACK_PEAK_GBPS)
    p.add_argument("--mem-budget-gb", type=float, default=40.0,
                   help="skip attention combos whose KV cache exceeds this many GB (default 40)")
    p.add_argument("--quick", action="store_true", help="smaller sweep")
    p.add_argument("--only", choices=["attention", "model"], default=None, help="run one part only")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    return p.parse_args(argv)


def peak_bandwidth(device_name: str, flag: float | None) -> tuple[float, str]:
    """(GB/s, where it came from): an explicit flag wins, then the table, then the fallback."""
    if flag is not None:
        return flag, "--peak-gbps"
    for needles, gbps in PEAK_GBPS_TABLE:
        if all(n in device_name for n in needles):
            return gbps, "device table"
    return FALLBACK_PEAK_GBPS, "fallback (device not in table; pass --peak-gbps)"


def _import_kernels():
    # `python bench/kernels.py` puts bench/ first on sys.path, where this very
    # file would shadow the `kernels` package: import it from the repo root.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    sys.path.insert(0, str(REPO))
    import kernels

    return kernels


def _bench_ms(fn) -> float:
    """Median ms per call; do_bench flushes L2 between calls so small caches are not flattered."""
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    except TypeError:  # older triton without return_mode
        return float(triton.testing.do_bench(fn, warmup=10, rep=50))


# ----------------------------------------------------------------------------
# (a) decode attention bandwidth
# ----------------------------------------------------------------------------


def bench_decode_attention(K, torch, args, peak_gbps):
    dev = torch.device("cuda")
    batches = ATTN_BATCHES_QUICK if args.quick else ATTN_BATCHES
    contexts = ATTN_CONTEXTS_QUICK if args.quick else ATTN_CONTEXTS
    hkv, hd, hq = ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_KV_HEADS * ATTN_GROUP
    bytes_per_token = 2 * hkv * hd * 2  # K and V, bf16
    budget = args.mem_budget_gb * 1e9
    combos = [(b, c) for b in batches for c in contexts]
    fits = [(b, c) for b, c in combos if b * c * bytes_per_token <= budget]
    rows = [dict(batch=b, context=c, skipped=f"KV {b * c * bytes_per_token / 1e9:.1f} GB > budget")
            for b, c in combos if (b, c) not in fits]
    if not fits:
        return rows
    # One pool sized for the largest combo, reused by all: sequences get random,
    # non-contiguous blocks from it, like a real paged cache.
    pool_blocks = max(b * c for b, c in fits) // BLOCK_SIZE
    k_cache = torch.empty(pool_blocks, BLOCK_SIZE, hkv, hd, dtype=torch.bfloat16, device=dev).normal_()
    v_cache = torch.empty_like(k_cache).normal_()
    scale = hd**-0.5
    for b, c in fits:
        nblk = c // BLOCK_SIZE
        tables = torch.randperm(pool_blocks, device=dev)[: b * nblk].view(b, nblk).int()
        ctx = torch.full((b,), c, dtype=torch.int32, device=dev)
        q = torch.randn(b, hq, hd, dtype=torch.bfloat16, device=dev)
        splits = K.choose_num_splits(b, hkv, c, dev)

        def run(q=q, tables=tables, ctx=ctx, splits=splits, k_cache=k_cache, v_cache=v_cache):  # bound now
            K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=splits)

        run()  # compile outside the timing
        ms = _bench_ms(run)
        kv_bytes = b * c * bytes_per_token
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        rows.append(dict(batch=b, context=c, num_splits=splits, time_us=ms * 1e3, kv_bytes=kv_bytes,
                         gbps=gbps, pct_peak=100.0 * gbps / peak_gbps))
        del tables, ctx, q
    del k_cache, v_cache
    torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r["batch"], r["context"]))
    return rows


def print_attention(rows):
    print("\n(a) paged_decode_attention, bf16, 32 q heads / 8 kv heads, head_dim 128, block 16")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'time us':>10} {'KV GB/s':>9} {'% peak':>7}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>8}  skipped: {r['skipped']}")
        else:
            print(f"{r['batch']:>6} {r['context']:>8} {r['num_splits']:>6} {r['time_us']:>10.1f} "
                  f"{r['gbps']:>9.0f} {r['pct_peak']:>6.1f}%")


# ----------------------------------------------------------------------------
# (b) decode step of a ~1B Llama-shaped model
# ----------------------------------------------------------------------------


class MiniLlama:
    """Random-weight Llama decoder built from the Strata kernels + torch matmuls.

    Weights are ``[out, in]`` for F.linear; q/k/v and gate/up are fused.
    """

    def __init__(self, K, torch, cfg, device, dtype):
        self.K, self.torch, self.cfg = K, torch, cfg
        h, L = cfg["hidden"], cfg["layers"]
        self.head_dim = h // cfg["heads"]
        self.q_size = cfg["heads"] * self.head_dim
        self.kv_size = cfg["kv_heads"] * self.head_dim
        gen = torch.Generator(device=device).manual_seed(0)

        def w(*shape):
            return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

        def norm():
            return torch.ones(h, device=device, dtype=dtype)

        self.embed = w(cfg["vocab"], h)
        self.layers = [dict(ln1=norm(), qkv=w(self.q_size + 2 * self.kv_size, h), o=w(h, self.q_size),
                            ln2=norm(), gate_up=w(2 * cfg["intermediate"], h), down=w(h, cfg["intermediate"]))
                       for _ in range(L)]
        self.final_norm = norm()
        self.lm_head = w(cfg["vocab"], h)
        self.cos_sin = K.compute_cos_sin_cache(self.head_dim, 4096, cfg["rope_base"]).to(device)
        self.scale = self.head_dim**-0.5

    def weight_bytes_read(self) -> int:
        """Bytes a decode step must stream: every layer weight, final norm, lm_head (not the embedding)."""
        n = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())
        return n + self.final_norm.numel() * self.final_norm.element_size() + \
            self.lm_head.numel() * self.lm_head.element_size()

    def decode_step(self, ids, positions, slot_mapping, kv_caches, block_tables, context_lens, num_splits):
        """One new token per sequence -> logits ``[batch, vocab]``."""
        K, F = self.K, self.torch.nn.functional
        cfg, hd = self.cfg, self.head_dim
        b = ids.shape[0]
        x = F.embedding(ids, self.embed)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                h, residual = K.rms_norm(x, layer["ln1"], cfg["eps"]), x
            else:
                h, residual = K.rms_norm(x, layer["ln1"], cfg["eps"], residual)
            qkv = F.linear(h, layer["qkv"])
            q = qkv[:, : self.q_size].view(b, cfg["heads"], hd)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(b, cfg["kv_heads"], hd)
            v = qkv[:, self.q_size + self.kv_size :].view(b, cfg["kv_heads"], hd)
            q, k = K.rotary_embedding(positions, q, k, self.cos_sin, hd)
            K.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
            attn = K.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, self.scale,
                                            num_splits=num_splits)
            x = F.linear(attn.view(b, self.q_size), layer["o"])
            h, residual = K.rms_norm(x, layer["ln2"], cfg["eps"], residual)
            x = F.linear(K.silu_and_mul(F.linear(h, layer["gate_up"])), layer["down"])
        h, _ = K.rms_norm(x, self.final_norm, cfg["eps"], residual)
        return F.linear(h, self.lm_head)


def make_decode_inputs(torch, model, batch, context, device, dtype):
    """Static inputs for one decode step: every sequence has ``context`` tokens
    (the new one included) in randomly scattered blocks of a fresh cache."""
    cfg, hd = model.cfg, model.head_dim
    nblk = -(-context // BLOCK_SIZE)
    num_blocks = batch * nblk
    kv_caches = [(torch.empty(num_blocks, BLOCK_SIZE, cfg["kv_heads"], hd, dtype=dtype, device=device).normal_(),
                  torch.empty(num_blocks, BLOCK_SIZE, cfg["kv_heads"], hd, dtype=dtype, device=device).normal_())
                 for _ in range(cfg["layers"])]
    tables = torch.randperm(num_blocks, device=device).view(batch, nblk).int()
    pos = context - 1
    positions = torch.full((batch,), pos, dtype=torch.int64, device=device)
    slot_mapping = (tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).contiguous()
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    ids = torch.randint(0, cfg["vocab"], (batch,), device=device)
    return dict(ids=ids, positions=positions, slot_mapping=slot_mapping, kv_caches=kv_caches,
                block_tables=tables, context_lens=context_lens)


def _time_loop_ms(torch, fn, iters):
    """Median per-iteration ms with CUDA events (includes CPU launch gaps, which is the point)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def bench_model(K, torch, args, peak_gbps):
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = MODEL
    model = MiniLlama(K, torch, cfg, dev, dtype)
    weight_bytes = model.weight_bytes_read()
    n_params = sum(t.numel() for layer in model.layers for t in layer.values()) + \
        model.embed.numel() + model.lm_head.numel() + model.final_norm.numel()
    iters = 10 if args.quick else 30
    rows = []
    for batch in (MODEL_BATCHES_QUICK if args.quick else MODEL_BATCHES):
        inp = make_decode_inputs(torch, model, batch, cfg["context"], dev, dtype)
        splits = K.choose_num_splits(batch, cfg["kv_heads"], cfg["context"], dev)

        def step(inp=inp, splits=splits):  # bound now: inp is deleted at the end of the loop
            return model.decode_step(inp["ids"], inp["positions"], inp["slot_mapping"], inp["kv_caches"],
                                     inp["block_tables"], inp["context_lens"], splits)

        # Warm up (compiles every kernel variant) on a side stream, as graph capture requires.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        eager_ms = _time_loop_ms(torch, step, iters)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        graph.replay()
        torch.cuda.synchronize()
        graph_ms = _time_loop_ms(torch, graph.replay, iters)
        ok = bool(torch.isfinite(logits).all())

        kv_bytes = cfg["layers"] * batch * cfg["context"] * 2 * cfg["kv_heads"] * model.head_dim * 2
        roofline_ms = (weight_bytes + kv_bytes) / (peak_gbps * 1e9) * 1e3
        rows.append(dict(batch=batch, context=cfg["context"], num_splits=splits, eager_ms=eager_ms,
                         graph_ms=graph_ms, roofline_ms=roofline_ms, weight_bytes=weight_bytes,
                         kv_bytes=kv_bytes, graph_pct_of_roofline=100.0 * roofline_ms / graph_ms,
                         eager_pct_of_roofline=100.0 * roofline_ms / eager_ms,
                         graph_tokens_per_s=batch / (graph_ms * 1e-3), logits_finite=ok))
        del graph, logits, inp
        torch.cuda.empty_cache()
    return rows, n_params


def print_model(rows, n_params):
    c = MODEL
    print(f"\n(b) decode step, Llama-shaped {n_params / 1e9:.2f}B params (hidden {c['hidden']}, {c['layers']} layers, "
          f"{c['heads']}/{c['kv_heads']} heads, inter {c['intermediate']}, vocab {c['vocab']}), bf16, "
          f"context {c['context']}")
    print(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'roofline ms':>12} {'graph % roof':>13} "
          f"{'eager % roof':>13} {'graph tok/s':>12}")
    for r in rows:
        print(f"{r['batch']:>6} {r['eager_ms']:>9.3f} {r['graph_ms']:>9.3f} {r['roofline_ms']:>12.3f} "
              f"{r['graph_pct_of_roofline']:>12.1f}% {r['eager_pct_of_roofline']:>12.1f}% "
              f"{r['graph_tokens_per_s']:>12.0f}" + ("" if r["logits_finite"] else "  (non-finite logits!)"))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.",
              file=sys.stderr)
        return 1
    if os.environ.pop("TRITON_INTERPRET", None) == "1":
        print("note: ignoring TRITON_INTERPRET=1, the benchmark runs compiled kernels", file=sys.stderr)
    K = _import_kernels()
    import triton

    t0 = time.time()
    name = torch.cuda.get_device_name()
    peak, peak_src = peak_bandwidth(name, args.peak_gbps)
    print(f"device: {name}; peak HBM {peak:.0f} GB/s ({peak_src}); torch {torch.__version__}, "
          f"triton {triton.__version__}{'; quick' if args.quick else ''}")
    result = dict(device=name, peak_gbps=peak, peak_source=peak_src, torch=torch.__version__,
                  triton=triton.__version__, quick=args.quick, mem_budget_gb=args.mem_budget_gb)
    with torch.inference_mode():
        if args.only in (None, "attention"):
            rows = bench_decode_attention(K, torch, args, peak)
            print_attention(rows)
            result["decode_attention"] = dict(kv_heads=ATTN_KV_HEADS, q_heads=ATTN_KV_HEADS * ATTN_GROUP,
                                              head_dim=ATTN_HEAD_DIM, block_size=BLOCK_SIZE, dtype="bfloat16",
                                              rows=rows)
        if args.only in (None, "model"):
            rows, n_params = bench_model(K, torch, args, peak)
            print_model(rows, n_params)
            result["model_decode"] = dict(config=MODEL, params=n_params, dtype="bfloat16", rows=rows)
    result["wall_s"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
