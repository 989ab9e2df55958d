"""The fp8 KV cache of the Triton kernels (kv_cache_dtype=fp8 on CUDA): the store quantizes each
row with its own scale, decode and prefill widen the tiles they load; each against the same
attention over the dequantized cache. On CPU under the Triton interpreter."""

import os

if os.environ.get("STRATA_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

import kernels as K
from services.engine.attention import AttentionMetadata
from services.engine.quantization import kv_cache

DEVICE = os.environ.get("STRATA_KERNEL_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"STRATA_KERNEL_DEVICE={DEVICE} but CUDA is not available", allow_module_level=True)

BLOCK, HKV, HQ, D = 16, 2, 4, 64


def filled_caches(lens, gen):
    """fp8 caches written by the store kernel, their dequantized fp32 copies, the block tables."""
    nblocks = [-(-n // BLOCK) for n in lens]
    total = sum(nblocks) + 2
    shape = (total, BLOCK, HKV, D)
    k8, v8 = (kv_cache.QuantizedKVCache(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE),
                                        torch.zeros(shape[:3], device=DEVICE)) for _ in range(2))
    perm = torch.randperm(total, generator=gen)
    tables = torch.zeros((len(lens), max(nblocks)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        tables[b, :nblocks[b]] = perm[used:used + nblocks[b]].int()
        used += nblocks[b]
        pos = torch.arange(n)
        slots = (tables[b].long()[pos // BLOCK] * BLOCK + pos % BLOCK).to(DEVICE)
        key = (torch.randn(n, HKV, D, generator=gen) * torch.rand(n, 1, 1, generator=gen) * 8).to(DEVICE)
        value = torch.randn(n, HKV, D, generator=gen).to(DEVICE)
        K.store_kv_cache(key, value, k8.data, v8.data, slots, k8.scales, v8.scales)
        # Each stored row is within fp8's rounding (3 mantissa bits) of the row it was given.
        back = kv_cache.dequantize_rows(k8.data.view(-1, HKV, D)[slots].float(), k8.scales.view(-1, HKV)[slots],
                                        torch.float32)
        torch.testing.assert_close(back, key, atol=1e-6, rtol=2 ** -3)
    dense = [kv_cache.dequantize_rows(c.data.float(), c.scales, torch.float32) for c in (k8, v8)]
    return k8, v8, dense, tables.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_decode_and_prefill_equal_attention_over_the_dequantized_cache(dtype):
    gen = torch.Generator().manual_seed(0)
    lens = [5, 40, 70]
    k8, v8, (k_dense, v_dense), tables = filled_caches(lens, gen)
    context = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), HQ, D, generator=gen).to(dtype).to(DEVICE)
    scale = D ** -0.5
    out = K.paged_decode_attention(q, k8.data, v8.data, tables, context, scale, k_scales=k8.scales,
                                   v_scales=v8.scales)
    ref = K.paged_decode_attention_ref(q.float(), k_dense, v_dense, tables, context, scale)
    # bf16: the widened tiles and the probabilities are rounded to bf16 (truncated, under the
    # interpreter) before their products; the reference keeps fp32.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    # Prefill: chunks of 3, 9 and 30 new tokens over what is cached before them.
    q_lens = [3, 9, 30]
    qp = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype).to(DEVICE)
    starts = torch.tensor([0, 3, 12, 42], dtype=torch.int32, device=DEVICE)
    out = K.paged_prefill_attention(qp, k8.data, v8.data, tables, starts, context, scale, k_scales=k8.scales,
                                    v_scales=v8.scales)
    ref = K.paged_prefill_attention_ref(qp.float(), k_dense, v_dense, tables, starts, context, scale)
    torch.testing.assert_close(out.float(), ref, **tol)


def test_fp8_attention_class_reads_the_quantized_cache():
    """The engine's fp8-KV Triton attention: one prefill step, then a decode step over it."""
    from services.engine.triton_backend import TritonOps

    ops = kv_cache.attention_ops(TritonOps, "fp8")
    attn = ops.attention_cls(HQ, HKV, D, D ** -0.5)
    gen = torch.Generator().manual_seed(1)
    shape = (4, BLOCK, HKV, D)
    caches = [kv_cache.QuantizedKVCache(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE),
                                        torch.zeros(shape[:3], device=DEVICE)) for _ in range(2)]
    n = 20
    q, k, v = (torch.randn(n + 1, h, D, generator=gen).to(DEVICE) for h in (HQ, HKV, HKV))
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2 * BLOCK + i for i in range(BLOCK)] + list(range(n + 1 - BLOCK)), device=DEVICE)
    prefill = AttentionMetadata(slots[:n], 0, empty.view(0, 0), empty, n, table,
                                torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                torch.tensor([n], dtype=torch.int32, device=DEVICE), [n], [n])
    attn.forward(q[:n], k[:n], v[:n], *caches, prefill)
    decode = AttentionMetadata(slots[n:], 1, table, torch.tensor([n + 1], dtype=torch.int32, device=DEVICE), 0,
                               empty.view(0, 0), empty, empty, [], [], decode_max_context=n + 1)
    out = attn.forward(q[n:], k[n:], v[n:], *caches, decode)
    dense = [kv_cache.dequantize_rows(c.data.float(), c.scales, torch.float32) for c in caches]
    ref = K.paged_decode_attention_ref(q[n:], *dense, table, torch.tensor([n + 1], device=DEVICE), D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    exact = K.paged_decode_attention_ref(q[n:], *(x.new_zeros(shape).index_put_(
        (slots // BLOCK, slots % BLOCK), x) for x in (k, v)), table, torch.tensor([n + 1], device=DEVICE), D ** -0.5)
    assert (out - exact).abs().max() < 0.1  # fp8's rounding, not garbage
