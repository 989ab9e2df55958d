"""The quantized KV cache: int8 on CPU, fp8 (e4m3) on CUDA, a scale per token and KV head.

Each layer's K (and V) cache is an int8 or fp8 tensor in the usual layout [num_blocks,
block_size, num_kv_heads, head_dim] with fp32 scales [num_blocks, block_size, num_kv_heads]
beside it; a row is stored as x / s with s = max|x| / 127 (int8, rounded) or / 448 (fp8), so
nothing needs calibrating and an outlier in one token costs precision in that token only. A
token's KV takes head_dim + 4 bytes per head instead of 2 * head_dim (bf16) or 4 * head_dim
(fp32): the cache holds proportionally more blocks at the same memory.

CPU: the decode kernel (kernels/cpu/paged_attention.c) reads the int8 rows and their scales in
place; prefill reads the chunk's own K and V at full precision and the cached context dequantized
(only the blocks of the sequence it attends to, per layer). CUDA: the Triton kernels
(kernels.attention) quantize on store and widen each fp8 tile as they load it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu as cpu_kernels
from services.engine.attention import AttentionMetadata, TorchAttention

INT8_MAX = 127.0
SCALE_BYTES = 4  # fp32 scale per token and KV head
CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass
class QuantizedKVCache:
    """One layer's K or V cache: integers and their per-(token, KV head) scales."""

    data: torch.Tensor  # int8 [num_blocks, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor  # fp32 [num_blocks, block_size, num_kv_heads]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def bytes_per_token(kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                    head_dim: int) -> int:
    """KV bytes of one token over all layers (K and V)."""
    if kv_cache_dtype == "auto":
        per_head = head_dim * torch.finfo(model_dtype).bits // 8
    else:
        per_head = head_dim + SCALE_BYTES
    return 2 * num_layers * num_kv_heads * per_head


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cache tensor; on CPU in huge pages: a decode step reads blocks scattered over the whole
    cache, a TLB miss each with 4 KB pages."""
    if device.type == "cpu":
        return cpu_kernels.huge_page_empty(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate(kv_cache_dtype: str, num_layers: int, shape: tuple[int, int, int, int], model_dtype: torch.dtype,
             device: torch.device) -> list[tuple]:
    """Every layer's (k_cache, v_cache)."""
    if kv_cache_dtype == "auto":
        return [(_zeros(shape, model_dtype, device), _zeros(shape, model_dtype, device)) for _ in range(num_layers)]
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} has no cache here")

    def one() -> QuantizedKVCache:
        return QuantizedKVCache(_zeros(shape, CACHE_DTYPES[kv_cache_dtype], device),
                                _zeros(shape[:3], torch.float32, device))

    return [(one(), one()) for _ in range(num_layers)]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, heads, head_dim] -> (int8 rows, fp32 scales [tokens, heads])."""
    xf = x.to(torch.float32)
    scales = xf.abs().amax(-1) / INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays zero
    q = torch.round(xf / scales[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scales[..., None]).to(dtype)


class Int8KVTorchAttention(TorchAttention):
    """TorchAttention over int8 caches (QuantizedKVCache): quantized stores, the int8 decode
    kernel, dequantized gathers for prefill and the portable decode path."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, out=None):
        self._dtype = q.dtype  # what dequantized gathers are read as
        return super().forward(q, k, v, k_cache, v_cache, meta, out)

    def _store(self, k, v, k_cache: QuantizedKVCache, v_cache: QuantizedKVCache, meta: AttentionMetadata) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        for x, cache in ((k, k_cache), (v, v_cache)):
            values, scales = quantize_rows(x)
            cache.data.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, values)
            cache.scales.view(-1, hkv).index_copy_(0, meta.slot_mapping, scales)

    def _gather(self, cache: QuantizedKVCache, index: torch.Tensor) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        blocks = cache.data.shape[0]
        values = cache.data.view(blocks, -1).index_select(0, index).view(-1, hkv, d)
        scales = cache.scales.view(blocks, -1).index_select(0, index).view(-1, hkv)
        return dequantize_rows(values, scales, self._dtype)

    def _decode(self, q, k_cache: QuantizedKVCache, v_cache: QuantizedKVCache, meta: AttentionMetadata,
                out: torch.Tensor):
        if q.dtype in cpu_kernels.KERNEL_DTYPES and (kernel := self._cpu_decode(meta)) is not None:
            return kernel(q, k_cache.data, v_cache.data, out, k_scales=k_cache.scales, v_scales=v_cache.scales)
        return super()._decode(q, k_cache, v_cache, meta, out)


def fp8_kv_triton_attention():
    """TritonAttention over fp8 caches: the kernels take the scales (imported with triton)."""
    from services.engine.triton_backend import TritonAttention

    class Fp8KVTritonAttention(TritonAttention):
        @staticmethod
        def _caches(k_cache: QuantizedKVCache, v_cache: QuantizedKVCache):
            return k_cache.data, v_cache.data, {"k_scales": k_cache.scales, "v_scales": v_cache.scales}

    return Fp8KVTritonAttention


def attention_ops(ops, kv_cache_dtype: str):
    """The device ops with the attention that reads a `kv_cache_dtype` cache."""
    if kv_cache_dtype == "auto":
        return ops
    if kv_cache_dtype == "int8" and ops.attention_cls is TorchAttention:
        return type(f"{ops.__name__}Int8KV", (ops,), {"attention_cls": Int8KVTorchAttention})
    if kv_cache_dtype == "fp8" and ops.name == "triton":
        return type(f"{ops.__name__}Fp8KV", (ops,), {"attention_cls": fp8_kv_triton_attention()})
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype} is not supported with the {ops.name} attention backend "
                     f"(int8: the torch backend on CPU; fp8: the triton backend on CUDA)")
