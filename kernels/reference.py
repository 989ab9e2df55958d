"""Plain-torch references for every Strata kernel.

Same signatures as the Triton versions (suffix ``_ref``). They favour being
obviously correct over being fast: attention loops over sequences, gathers the
sequence's KV through the block table and does dense fp32 math. They run on
CPU and CUDA and are what the kernel tests compare against.

KV cache layout (fixed): ``[num_blocks, block_size, num_kv_heads, head_dim]``
per layer; token at logical position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "store_kv_cache_ref",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
    "rms_norm_ref",
    "rotary_embedding_ref",
    "silu_and_mul_ref",
    "compute_cos_sin_cache",
    "gather_kv_ref",
]


# ----------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------


def store_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write token ``i`` of key/value into slot ``slot_mapping[i]`` (in place); -1 = skip."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat[slots[keep]] = key[keep].to(k_cache.dtype)
    v_flat[slots[keep]] = value[keep].to(v_cache.dtype)


def gather_kv_ref(k_cache, v_cache, block_table_row, length: int):
    """K and V of the first ``length`` tokens of one sequence, ``[length, kv_heads, head_dim]``."""
    block_size = k_cache.shape[1]
    pos = torch.arange(length, device=k_cache.device)
    blocks = block_table_row.long()[pos // block_size]
    offs = pos % block_size
    return k_cache[blocks, offs], v_cache[blocks, offs]


def _attend(q, k, v, scale, mask):
    """q [n, Hq, D], k/v [L, Hkv, D], mask [n, L] (True = attend). fp32 result [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    # q head j reads kv head j // group (same as HF repeat_kv).
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


def paged_decode_attention_ref(
    query, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None, max_context_len=None
):
    """One query token per sequence attending to its ``context_lens[b]`` cached tokens.

    ``num_splits``/``max_context_len`` are accepted for signature parity and ignored.
    A sequence with context length 0 gets an all-zero output.
    """
    batch, num_q_heads, head_dim = query.shape
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=query.device)
    for b in range(batch):
        length = int(context_lens[b])
        if length == 0:
            continue
        k, v = gather_kv_ref(k_cache, v_cache, block_tables[b], length)
        mask = torch.ones(1, length, dtype=torch.bool, device=query.device)
        out[b] = _attend(query[b : b + 1], k, v, scale, mask)[0]
    return out.to(query.dtype)


def paged_prefill_attention_ref(
    query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
):
    """Causal attention of packed new tokens over cached prefix + themselves.

    New token ``i`` of sequence ``b`` (chunk of ``q_len`` tokens) sits at absolute
    position ``context_lens[b] - q_len + i`` and sees cache positions ``<=`` it.
    """
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    batch = context_lens.shape[0]
    for b in range(batch):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, length = end - start, int(context_lens[b])
        if q_len == 0:
            continue
        k, v = gather_kv_ref(k_cache, v_cache, block_tables[b], length)
        q_pos = torch.arange(length - q_len, length, device=query.device)
        k_pos = torch.arange(length, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out[start:end] = _attend(query[start:end], k, v, scale, mask)
    return out.to(query.dtype)


# ----------------------------------------------------------------------------
# Norm / activation
# ----------------------------------------------------------------------------


def rms_norm_ref(x, weight, eps, residual=None):
    """RMSNorm in fp32; with ``residual`` the fused add of vLLM's fused_add_rms_norm.

    Returns ``normed`` or ``(normed, new_residual)`` with ``new_residual = x + residual``
    (rounded to the residual's dtype, as an unfused add would store it) and
    ``normed = rmsnorm(new_residual) * weight``. The product with ``weight`` is taken
    in fp32 and rounded once (HF rounds before multiplying; differs by <= 1 ulp).
    """
    if residual is not None:
        new_residual = (x.float() + residual.float()).to(residual.dtype)
        h = new_residual.float()
    else:
        h = x.float()
    var = h.pow(2).mean(dim=-1, keepdim=True)
    normed = (h * torch.rsqrt(var + eps) * weight.float()).to(x.dtype)
    if residual is None:
        return normed
    return normed, new_residual


def silu_and_mul_ref(x):
    """``silu(x[..., :d]) * x[..., d:]`` computed in fp32."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


# ----------------------------------------------------------------------------
# Rotary embedding
# ----------------------------------------------------------------------------


def rope_inverse_frequencies(head_dim: int, base: float, scaling: Optional[dict] = None,
                             max_position: int = 2048) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the factor applied to cos/sin, matching Hugging Face
    transformers' rope init for ``default``, ``linear``, ``llama3`` (Llama 3.1) and ``yarn``
    (Qwen2.5 long context). The older key ``"type"`` is accepted for ``"rope_type"``.
    ``"dynamic"`` (NTK scaling depends on the current length, so one static table cannot hold
    it), ``"longrope"`` and others raise ValueError."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band in between
        # interpolated smoothly (same formula as Meta / HF).
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        factor = scaling["factor"]
        old_ctx = scaling.get("original_max_position_embeddings") or max_position
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(correction_dim(beta_fast)), 0)
        hi = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo if hi != lo else 0.001)
        extrapolation = 1 - ramp.clamp(0, 1)
        return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation, mscale
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def compute_cos_sin_cache(head_dim: int, max_position: int, base: float, scaling: Optional[dict] = None):
    """``[max_position, head_dim]`` fp32 table: cos in the first half, sin in the second
    (row ``p`` holds ``cos(p * inv_freq)``, ``sin(p * inv_freq)``; see rope_inverse_frequencies)."""
    inv_freq, mscale = rope_inverse_frequencies(head_dim, base, scaling, max_position)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1).float()


def rotary_embedding_ref(positions, query, key, cos_sin_cache, head_dim):
    """NeoX / HF-Llama rotate_half rotary embedding; returns new ``(query, key)``.

    query/key are ``[num_tokens, heads, head_dim]`` or flattened ``[num_tokens, heads * head_dim]``.
    """

    def rotate(x):
        shape = x.shape
        x = x.reshape(shape[0], -1, head_dim).float()
        cs = cos_sin_cache[positions.long()].float()
        half = head_dim // 2
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.reshape(shape)

    return rotate(query).to(query.dtype), rotate(key).to(key.dtype)
