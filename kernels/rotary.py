"""Rotary position embedding, GPT-NeoX / HF-Llama layout (rotate_half).

Dim ``i`` pairs with dim ``i + head_dim // 2`` (not the interleaved GPT-J
layout). The cos/sin table comes from
:func:`kernels.reference.compute_cos_sin_cache`: ``[max_position, head_dim]``
fp32, cos in the first half of the last dim, sin in the second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_device, next_pow2


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, t, stride_t, stride_h, stride_ot, stride_oh, num_heads, cos, sin,
                  half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_c[None, :] < half)
    src = src_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = dst_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_mask = offs_c < half
    # One token per program: its cos/sin row is loaded once for all q and k heads.
    cos = tl.load(cs_ptr + pos * stride_cs + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + half + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, num_q_heads,
                  cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, num_k_heads,
                  cos, sin, half, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(positions, query, key, cos_sin_cache, head_dim):
    """Apply rotary embedding at ``positions [num_tokens]``.

    ``query [num_tokens, Hq, head_dim]`` and ``key [num_tokens, Hkv, head_dim]``
    (or flattened ``[num_tokens, heads * head_dim]``; strided views with a
    contiguous last dim are fine). ``cos_sin_cache [max_position, head_dim]``
    must cover the full head dim. Returns new ``(query_rot, key_rot)`` with the
    input shapes and dtypes; inputs are not modified.
    """
    check_device(query)
    num_tokens = query.shape[0]
    assert cos_sin_cache.shape[-1] == head_dim, "partial rotary is not supported"
    q3 = query.view(num_tokens, -1, head_dim)
    k3 = key.view(num_tokens, -1, head_dim)
    q_out = torch.empty(q3.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(k3.shape, dtype=key.dtype, device=key.device)
    if num_tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, q3, k3, cos_sin_cache, q_out, k_out,
            q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            q3.shape[1], k3.shape[1], half,
            BLOCK_HQ=next_pow2(q3.shape[1]), BLOCK_HK=next_pow2(k3.shape[1]), BLOCK_HALF=next_pow2(half),
            num_warps=4,
        )
    return q_out.view(query.shape), k_out.view(key.shape)
