"""The CPU kernels that read quantized data in place: the int8/int4 weight-only linear layer
(kernels/cpu/quant_linear.c) and decode attention over an int8 KV cache (kernels/cpu/
paged_attention.c), each against dequantize-then-compute references."""

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.cpu import quant as cpu_quant
from kernels.reference import paged_decode_attention_ref
from services.engine.quantization import kv_cache
from services.engine.quantization.weights import QuantizedWeight, quantize, scheme_args

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")


def reference(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantize, then matmul, in fp64."""
    out = x.double() @ q.dequantize(torch.float64).t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 1152, 896), (3, 100, 256), (7, 64, 512),
                                                           (33, 200, 384)])
def test_quantized_linear_equals_dequantize_then_matmul(kind, dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    q = quantize(w.to(dtype), scheme_args(kind))
    packed = cpu_quant.pack(q.values, q.scales, q.bits, q.group_size)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    for b in (None, bias):
        out = cpu_quant.qlinear(x, packed, b)
        ref = reference(x, q, b)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        if dtype == torch.float32:  # fp32 sums in another order
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        else:  # the fp32 result rounded once to bf16 (half an ulp), plus the fp32 sums' error
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=2 ** -8)


def test_packed_weight_holds_bits_per_weight():
    q = quantize(torch.randn(256, 1024), scheme_args("int4"))
    packed = cpu_quant.pack(q.values, q.scales, q.bits, q.group_size)
    assert packed.words.numel() * 4 == 256 * 1024 // 2  # two int4 per byte
    assert packed.scales.numel() == 256 * 1024 // 128
    q8 = quantize(torch.randn(256, 1024), scheme_args("int8"))
    assert cpu_quant.pack(q8.values, q8.scales, 8, q8.group_size).words.numel() * 4 == 256 * 1024


def test_quantized_linear_refuses_bad_input():
    q = quantize(torch.randn(64, 256), scheme_args("int8"))
    packed = cpu_quant.pack(q.values, q.scales, q.bits, q.group_size)
    with pytest.raises(ValueError, match="input features"):
        cpu_quant.qlinear(torch.randn(2, 128), packed)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        cpu_quant.qlinear(torch.randn(2, 256, dtype=torch.float16), packed)
    with pytest.raises(ValueError, match="groups of"):
        cpu_quant.pack(torch.zeros(64, 200, dtype=torch.int8), torch.ones(64, 2), 4, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (8, 8, 128), (4, 1, 80), (6, 2, 36)])
def test_int8_kv_decode_kernel_equals_attention_over_the_dequantized_cache(dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    block_size, lens = 16, [1, 15, 16, 37, 300, 1100]  # spans split a long context when the batch is small
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (kv_cache.QuantizedKVCache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:3]))
                        for _ in range(2))
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((len(lens), max(-(-n // block_size) for n in lens)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
        slots = (tables[b].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size)
        for cache in (k_cache, v_cache):
            rows, scales = kv_cache.quantize_rows(torch.randn(n, num_kv_heads, head_dim, generator=gen) * 2)
            cache.data.view(-1, num_kv_heads, head_dim)[slots] = rows
            cache.scales.view(-1, num_kv_heads)[slots] = scales
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    context = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = cpu_kernels.paged_decode_attention(q, k_cache.data, v_cache.data, tables, context, scale,
                                             k_scales=k_cache.scales, v_scales=v_cache.scales)
    dense_k = kv_cache.dequantize_rows(k_cache.data, k_cache.scales, torch.float32)
    dense_v = kv_cache.dequantize_rows(v_cache.data, v_cache.scales, torch.float32)
    ref = paged_decode_attention_ref(q.float(), dense_k, dense_v, tables, context, scale)
    assert out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_int8_kv_rows_round_trip_within_half_a_step():
    x = torch.randn(50, 2, 64) * torch.logspace(-3, 2, 50).view(50, 1, 1)  # rows of every magnitude
    x[3] = 0.0  # an all-zero row stays exactly zero
    q, s = kv_cache.quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (50, 2)
    back = kv_cache.dequantize_rows(q, s, torch.float32)
    assert torch.all((back - x).abs() <= s[..., None] * 0.5 + 1e-12)
    assert torch.equal(back[3], x[3])
