"""The Triton backend: the engine's ops as the kernels in kernels/ (CUDA; or CPU under the
Triton interpreter, for tests). Same cache layout and metadata as the torch backend."""

from __future__ import annotations

import torch

import kernels
from services.engine.attention import AttentionMetadata


class TritonAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, heads, head_dim], written into `out` when given (as TorchAttention)."""
        k_cache, v_cache, scales = self._caches(k_cache, v_cache)
        kernels.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        nd = meta.num_decodes
        if not meta.num_prefill_tokens and out is None:  # decode-only steps (and CUDA graphs): no copy
            # max_context_len=None bounds splits by the block table width: no host sync.
            return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale, **scales)
        if out is None:
            out = torch.empty_like(q)
        if nd:
            out[:nd] = kernels.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                      meta.decode_context_lens, self.scale,
                                                      max_context_len=meta.decode_max_context, **scales)
        if meta.num_prefill_tokens:
            out[nd:] = kernels.paged_prefill_attention(q[nd:].contiguous(), k_cache, v_cache, meta.prefill_block_tables,
                                                       meta.prefill_query_start_loc, meta.prefill_context_lens,
                                                       self.scale, **scales)
        return out

    @staticmethod
    def _caches(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The cache tensors the kernels read, and their scales (quantized caches only)."""
        return k_cache, v_cache, {}


class TritonOps:
    name = "triton"
    attention_cls = TritonAttention

    @staticmethod
    def rms_norm(x, weight, eps, residual=None):
        return kernels.rms_norm(x, weight, eps, residual)

    @staticmethod
    def silu_and_mul(x):
        return kernels.silu_and_mul(x)

    @staticmethod
    def rotary(positions, q, k, cache, head_dim):
        return kernels.rotary_embedding(positions, q, k, cache, head_dim)
