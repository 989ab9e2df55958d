"""Attention over the paged KV cache, behind one interface for every device.

Cache layout, shared by all backends and the Triton kernels: per layer, k_cache and v_cache of
shape [num_blocks, block_size, num_kv_heads, head_dim]. A token at position p of a sequence
lives in slot block_table[p // block_size] * block_size + p % block_size.

In a step's flat token batch the decode tokens (one per sequence) come first, then the prefill
chunks packed back to back. The metadata below is built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token of the step
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, including the new token
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets within the prefill part
    prefill_context_lens: torch.Tensor  # [num_prefills] int32: cached + new tokens
    # Host-side copies for the torch backend's loops.
    prefill_query_lens_host: list[int]
    prefill_context_lens_host: list[int]
    decode_max_context: int = 0
    # Built lazily by the torch backend and reused by every layer of the step.
    decode_gather_index: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    cpu_decode: cpu_kernels.PagedDecode | None = None  # the C decode kernel's converted tables
    prefill_gather_index: list[torch.Tensor | None] | None = None


class TorchAttention:
    """Portable attention in plain torch (the CPU path): gather the blocks, then SDPA.

    On CPU with fp32 or bf16, decode and prefill use the C kernels in kernels.cpu instead, which
    read the cache through the block table without the gather copy (prefill: flash attention,
    kernels/cpu/prefill_attention.c, where the CPU has AVX-512 or AVX2: elsewhere SDPA is faster).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.cpu_kernels = cpu_kernels.load() is not None
        self.prefill_kernel = self.cpu_kernels and cpu_kernels.prefill_kernel_vectorized()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, heads, head_dim], written into `out` when given (a view of a bigger buffer)."""
        self._store(k, v, k_cache, v_cache, meta)
        if out is None:
            out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta, out[:nd])
        if meta.num_prefill_tokens:
            self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, out[nd:])
        return out

    def _store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        """The step's new K and V rows into their cache slots."""
        if self.cpu_kernels and k.device.type == "cpu" and k.dtype in cpu_kernels.KERNEL_DTYPES:
            cpu_kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # one call, no copies of k and v
            return
        hkv, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)

    def _gather(self, cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Blocks listed in index, as [len(index) * block_size, Hkv, D]."""
        return cache.view(cache.shape[0], -1).index_select(0, index).view(-1, self.num_kv_heads, self.head_dim)

    def _cpu_decode(self, meta: AttentionMetadata) -> cpu_kernels.PagedDecode | None:
        """The step's C decode kernel call (its tables converted once, for every layer); None
        where the kernel does not run."""
        if meta.cpu_decode is None and self.cpu_kernels and meta.decode_block_tables.device.type == "cpu":
            meta.cpu_decode = cpu_kernels.PagedDecode(meta.decode_block_tables, meta.decode_context_lens, self.scale)
        return meta.cpu_decode

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> torch.Tensor:
        """Into `out` (a view of the step's output rows)."""
        if q.dtype in cpu_kernels.KERNEL_DTYPES and (kernel := self._cpu_decode(meta)) is not None:
            return kernel(q, k_cache, v_cache, out)
        b, block_size = q.shape[0], k_cache.shape[1]
        if meta.decode_gather_index is None:
            num_blocks = -(-meta.decode_max_context // block_size)
            tables = meta.decode_block_tables[:, :num_blocks]
            meta.decode_gather_index = tables.reshape(-1).long()
            span = torch.arange(num_blocks * block_size, device=q.device)
            meta.decode_mask = (span[None, :] < meta.decode_context_lens[:, None]).view(b, 1, 1, -1)
        keys = self._gather(k_cache, meta.decode_gather_index).view(b, -1, self.num_kv_heads, self.head_dim)
        values = self._gather(v_cache, meta.decode_gather_index).view(b, -1, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        # GQA without copies: the query heads of one KV head act as that head's query rows.
        qg = q.view(b, self.num_kv_heads, group, self.head_dim)
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=meta.decode_mask, scale=self.scale)
        return out.copy_(o.reshape(b, self.num_heads, self.head_dim))

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        if (self.prefill_kernel and q.device.type == "cpu" and q.dtype in cpu_kernels.KERNEL_DTYPES
                and isinstance(k_cache, torch.Tensor) and k_cache.dtype == q.dtype
                and self.head_dim % 16 == 0 and self.head_dim <= 256):
            # One call for every chunk, through the block tables: the new K/V are already stored.
            # The kernel takes any token stride (q is a view into the fused qkv), heads contiguous.
            direct = cpu_kernels.heads_contiguous(out)
            o = cpu_kernels.paged_prefill_attention_cpu(
                q if cpu_kernels.heads_contiguous(q) else q.contiguous(), k_cache, v_cache, meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_context_lens, self.scale, out=out if direct else None)
            if not direct:
                out.copy_(o)
            return
        block_size = k_cache.shape[1]
        if meta.prefill_gather_index is None:
            meta.prefill_gather_index = []
            for i, (qlen, ctx) in enumerate(zip(meta.prefill_query_lens_host, meta.prefill_context_lens_host)):
                if ctx == qlen:
                    meta.prefill_gather_index.append(None)  # nothing cached before the chunk
                else:
                    nblocks = -(-ctx // block_size)
                    meta.prefill_gather_index.append(meta.prefill_block_tables[i, :nblocks].long())
        start = 0
        for qlen, ctx, index in zip(meta.prefill_query_lens_host, meta.prefill_context_lens_host,
                                    meta.prefill_gather_index):
            end = start + qlen
            qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if index is None:
                ks, vs = k[start:end], v[start:end]
                mask, causal = None, True
            else:
                ks = self._gather(k_cache, index)[:ctx]
                vs = self._gather(v_cache, index)[:ctx]
                first = ctx - qlen  # absolute position of the chunk's first token
                rows = torch.arange(first, ctx, device=q.device)[:, None]
                mask, causal = torch.arange(ctx, device=q.device)[None, :] <= rows, False
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
            start = end
