"""Compile every Triton kernel for a GPU target without a GPU (ahead of time).

The interpreter runs kernels as numpy code, so it cannot see errors that only the
compiler raises (loop-carried type changes, tl.dot shape limits, value
specialization of int arguments equal to 1, shared-memory overflow). This script
compiles one realistic variant of each kernel for sm_90 through Triton's own
compiler and ptxas, which ship with the CPU wheel. Run in a process where
TRITON_INTERPRET is unset (the test does so); prints one line per kernel and exits
non-zero if any failed.

    python tests/kernels/aot_compile_check.py [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.activation as ACT  # noqa: E402
import kernels.attention as A  # noqa: E402
import kernels.lora as L  # noqa: E402
import kernels.norm as N  # noqa: E402
import kernels.quant_matmul as Q  # noqa: E402
import kernels.rotary as R  # noqa: E402
import kernels.sampling as S  # noqa: E402

# Sizes the GPU launchers use (kernels.attention._DECODE_BLOCK_N / _PREFILL_BLOCKS).
DECODE_BLOCK_N = A._DECODE_BLOCK_N["cuda"]
PREFILL_BLOCK_M, PREFILL_BLOCK_N = A._PREFILL_BLOCKS["cuda"]
MAX_SHARED = 227 * 1024  # H100/H200 per-block opt-in limit


def compile_kernel(kern, types, consts, arch, num_warps=4, num_stages=2):
    sig, cdict = {}, {}
    for i, name in enumerate(kern.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            cdict[(i,)] = consts[name]
        else:
            sig[name] = types[name]
    src = ASTSource(kern, sig, cdict)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def variants():
    i32 = "i32"
    # (query dtype, cache dtype): the model's own cache, or fp8 with scales (kv_cache_dtype=fp8).
    for dt, cache, fp32 in (("bf16", "bf16", False), ("fp32", "fp32", True), ("bf16", "fp8e4nv", False)):
        p = "*" + dt
        scaled = cache.startswith("fp8")
        attn = dict(k_cache_ptr="*" + cache, v_cache_ptr="*" + cache, k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                    block_tables_ptr="*i32", context_lens_ptr="*i32",
                    scale_log2="fp32", stride_cb=i32, stride_cs=i32, stride_ch=i32, stride_bt=i32, head_dim=i32)
        dt = dt if not scaled else f"{dt} cache {cache}"
        for direct in (True, False):
            consts = dict(GROUP=4, PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=DECODE_BLOCK_N, BLOCK_D=128,
                          DIRECT=direct, DOT_FP32=fp32, SCALED=scaled)
            if direct:
                consts["num_splits"] = 1  # what Triton's value specialization of 1 produces
            yield (f"decode_split {dt} direct={direct}", A._decode_split_kernel,
                   dict(attn, q_ptr=p, out_ptr=p, part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                        num_splits=i32, stride_qb=i32, stride_qh=i32, stride_ob=i32, stride_oh=i32), consts)
        yield (f"prefill {dt} num_seqs=1", A._prefill_kernel,
               dict(attn, q_ptr=p, out_ptr=p, query_start_loc_ptr="*i32", num_seqs=i32,
                    stride_qt=i32, stride_qh=i32, stride_ot=i32, stride_oh=i32),
               dict(GROUP=4, PAGE_SIZE=16, BLOCK_Q=PREFILL_BLOCK_M // 4, BLOCK_G=4, BLOCK_M=PREFILL_BLOCK_M,
                    BLOCK_N=PREFILL_BLOCK_N, BLOCK_D=128, DOT_FP32=fp32, num_seqs=1, SCALED=scaled))
    # Weight-only quantized matmuls as kernels.quant_matmul launches them (decode and prefill tiles).
    for mode, name, w_type, group in ((Q.MODE_INT8, "int8", "*i8", 896), (Q.MODE_INT4, "int4", "*u8", 128),
                                      (Q.MODE_FP8, "fp8", "*u8", 896)):
        for block_m in (16, 64):
            yield (f"quant_matmul {name} bf16 block_m={block_m}", Q._quant_matmul_kernel,
                   dict(x_ptr="*bf16", w_ptr=w_type, s_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16", M=i32, N=i32,
                        K=i32, stride_xm=i32, stride_wn=i32, stride_sn=i32, stride_ym=i32),
                   dict(GROUP=group, MODE=mode, HAS_BIAS=True, FP32=False, BLOCK_M=block_m, BLOCK_N=64,
                        BLOCK_K=Q._block_k(group, 896)))
    p = "*bf16"
    yield ("prefill bf16 group=8", A._prefill_kernel,
           dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                block_tables_ptr="*i32", query_start_loc_ptr="*i32",
                context_lens_ptr="*i32", out_ptr=p, scale_log2="fp32", num_seqs=i32, stride_qt=i32, stride_qh=i32,
                stride_ot=i32, stride_oh=i32, stride_cb=i32, stride_cs=i32, stride_ch=i32, stride_bt=i32,
                head_dim=i32),
           dict(GROUP=8, PAGE_SIZE=16, BLOCK_Q=PREFILL_BLOCK_M // 8, BLOCK_G=8, BLOCK_M=PREFILL_BLOCK_M,
                BLOCK_N=PREFILL_BLOCK_N, BLOCK_D=64, DOT_FP32=False, SCALED=False))
    yield ("decode_merge bf16", A._decode_merge_kernel,
           dict(out_ptr=p, part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", num_splits=i32,
                stride_ob=i32, stride_oh=i32, head_dim=i32), dict(BLOCK_S=32, BLOCK_D=128))
    for cache in ("bf16", "fp8e4nv"):
        yield (f"store_kv_cache bf16 cache {cache}", A._store_kv_cache_kernel,
               dict(key_ptr=p, value_ptr=p, k_cache_ptr="*" + cache, v_cache_ptr="*" + cache, slot_ptr="*i64",
                    k_scale_ptr="*fp32", v_scale_ptr="*fp32", stride_kt=i32, stride_kh=i32, stride_vt=i32,
                    stride_vh=i32, stride_cb=i32, stride_cs=i32, stride_ch=i32, num_heads=i32, head_dim=i32),
               dict(PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=128, SCALED=cache != "bf16"))
    yield ("rms_norm bf16 residual", N._rms_norm_kernel,
           dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, res_out_ptr=p, stride_x=i32, stride_r=i32, stride_o=i32,
                stride_ro=i32, hidden=i32, eps="fp32"), dict(HAS_RES=True, BLOCK=4096))
    yield ("rotary bf16", R._rotary_kernel,
           dict(pos_ptr="*i64", q_ptr=p, k_ptr=p, cs_ptr="*fp32", qo_ptr=p, ko_ptr=p, stride_qt=i32, stride_qh=i32,
                stride_kt=i32, stride_kh=i32, stride_qot=i32, stride_qoh=i32, stride_kot=i32, stride_koh=i32,
                stride_cs=i32, num_q_heads=i32, num_k_heads=i32, half=i32),
           dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64))
    yield ("silu_and_mul bf16", ACT._silu_and_mul_kernel,
           dict(x_ptr=p, out_ptr=p, stride_x=i32, stride_o=i32, d=i32), dict(BLOCK=1024))
    # LoRA at max_lora_rank 64 on a fused qkv (3 slices: 192 rows), as kernels.lora launches them.
    yield ("bgmv_shrink bf16", L._bgmv_shrink_kernel,
           dict(x_ptr=p, a_ptr=p, slot_ptr="*i32", y_ptr="*fp32", K=i32, N=i32, stride_x=i32, stride_al=i32,
                stride_an=i32, stride_y=i32), dict(BLOCK_N=64, BLOCK_K=128))
    yield ("bgmv_expand bf16 rows=192", L._bgmv_expand_kernel,
           dict(y_ptr="*fp32", b_ptr=p, slot_ptr="*i32", out_ptr=p, R=i32, N=i32, stride_y=i32, stride_bl=i32,
                stride_br=i32, stride_o=i32), dict(BLOCK_N=64, BLOCK_R=256))
    # The sampler's draws at L's shape: top-k 50 candidates (k + tie room: 306 wide), whole rows of
    # 151,936 bf16 logits with top-p and min-p.
    yield ("log_sum_exp bf16", S._log_sum_exp_kernel, dict(x_ptr=p, out_ptr="*fp32", vocab=i32, stride_x=i32),
           dict(BLOCK=S.WHOLE_ROW_BLOCK))
    yield ("penalized_values bf16", S._penalties_kernel,
           dict(logits_ptr=p, rows_ptr="*i64", ids_ptr="*i64", counts_ptr="*fp32", repetition_ptr="*fp32",
                frequency_ptr="*fp32", presence_ptr="*fp32", out_ptr="*fp32", width=i32, stride_l=i32, stride_i=i32,
                stride_c=i32, stride_o=i32), dict(HAS_REPETITION=True, HAS_COUNTS=True, BLOCK=1024))
    yield ("sample_candidates top-p min-p", S._candidates_kernel,
           dict(values_ptr="*bf16", ids_ptr="*i64", index_ptr="*i64", top_k_ptr="*i64", temperature_ptr="*fp32",
                top_p_ptr="*fp32", log_min_p_ptr="*fp32", uniform_ptr="*fp64", chosen_ptr="*i64",
                incomplete_ptr="*i8", width=i32, stride_v=i32, stride_i=i32, stride_u=i32),
           dict(ALL_CANDIDATES=False, HAS_TOP_P=True, HAS_MIN_P=True, BLOCK=512))
    yield ("sample_whole_rows bf16 top-p min-p", S._whole_rows_kernel,
           dict(x_ptr=p, index_ptr="*i64", temperature_ptr="*fp32", top_p_ptr="*fp32", log_min_p_ptr="*fp32",
                uniform_ptr="*fp64", chosen_ptr="*i64", pending_ptr="*i8", vocab=i32, stride_x=i32, stride_u=i32),
           dict(HAS_TOP_P=True, HAS_MIN_P=True, ROUNDS=3, BLOCK=S.WHOLE_ROW_BLOCK))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    failed = 0
    for name, kern, types, consts in variants():
        try:
            compiled = compile_kernel(kern, types, consts, args.arch)
            shared = compiled.metadata.shared
            status = "ok" if shared <= MAX_SHARED else f"FAIL shared memory {shared} B > {MAX_SHARED}"
        except Exception as exc:  # report every kernel, not just the first failure
            status = f"FAIL {type(exc).__name__}: {exc}"
        failed += not status.startswith("ok")
        print(f"sm_{args.arch} {name}: {status}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
