"""Rotary position embedding tables, with the rope scaling types Llama 3 and Qwen2 use."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None,
                        max_position: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the attention scaling factor applied to cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":  # Llama 3.1: rescale low frequencies, keep high ones, blend between
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    if rope_type == "yarn":  # Qwen2.5 long context
        factor = scaling["factor"]
        old_ctx = scaling.get("original_max_position_embeddings", max_position)
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        extrapolation = 1 - ramp.clamp(0, 1)
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq, mscale
    raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos in the first half of the last dim, sin in the second."""
    inv_freq, mscale = inverse_frequencies(head_dim, theta, scaling, max_position)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos() * mscale, angles.sin() * mscale], dim=-1)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX/Hugging Face style (rotate_half) on q [T, Hq, D] and k [T, Hkv, D]."""
    cos, sin = cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
