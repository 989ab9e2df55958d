"""The CPU layer-op kernels (kernels/cpu/layer_ops.c) against the plain torch path they replace:
RMSNorm with and without the fused residual add, rotary embedding over strided views of a fused
qkv projection, SwiGLU; fp32 to rounding noise, bf16 within one rounding of the result."""

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.reference import compute_cos_sin_cache, rotary_embedding_ref

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]


def close(ours, ref, dtype):
    # bf16: results may differ by one rounding of a value (2**-8 relative).
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)
    torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=rtol)


def reference_rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed, residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 896, 1000])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(37, hidden, generator=g).to(dtype)
    res = torch.randn(37, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    ref, _ = reference_rms_norm(x, w, 1e-6)
    close(cpu_kernels.rms_norm(x, w, 1e-6), ref, dtype)
    ref, ref_res = reference_rms_norm(x, w, 1e-6, res)
    ours_res = res.clone()
    close(cpu_kernels.rms_norm(x, w, 1e-6, ours_res), ref, dtype)
    assert torch.equal(ours_res, ref_res)  # the residual sum, rounded like torch's add


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_strided_view(dtype):
    """Qwen3's q/k norms: rows are the heads of a view into the fused projection."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 6 * 128 + 2 * 2 * 128, generator=g).to(dtype)
    q = qkv[:, :6 * 128].reshape(9, 6, 128)
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(dtype)
    close(cpu_kernels.rms_norm(q, w, 1e-6), reference_rms_norm(q, w, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])  # 80: half a head is not 16 lanes (the plain loop)
def test_rotary_in_place_on_views_of_qkv(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, n = 14, 2, 11
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    table = compute_cos_sin_cache(head_dim, 4096, 1e6)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 512, 1000, 2047, 3000, 4095])
    ref_q, ref_k = rotary_embedding_ref(positions, q.clone(), k.clone(), table, head_dim)
    cpu_kernels.rotary(positions, q, k, table)
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1408, 1000])  # 1000: not 16 lanes (the plain loop)
def test_silu_and_mul(dtype, width):
    x = (3 * torch.randn(33, 2 * width, generator=torch.Generator().manual_seed(1))).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    close(cpu_kernels.silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype)
