"""Linear layers over bf16 weights in a blocked layout: the layout and the calls into
kernels/cpu/blocked_linear.c (see its header for the layout, the tiles and why).

`pack` lays a weight out once, at load; `linear` runs y = x W^T (+ bias) on it:
- bf16 activations on CPUs with AVX512-BF16 (`available`; else callers keep oneDNN's packed
  matmul). A fused gate/up weight packed with `swiglu=True` also runs `swiglu`: silu(x G^T) *
  (x U^T) in the same pass, the activation applied to the product's tiles while in registers.
- fp32 activations on CPUs with AVX2 and FMA (`available_f32`), for an fp32 model whose weights
  are bf16 values (`bf16_exact`: a bf16 checkpoint upcast): the same products as fp32 weights,
  from half the bytes; decode batches straight from the pairs, prefill chunks through an fp32
  panel of each block (blocked_linear.c); with AVX-512, 512-bit tiles straight from the pairs at
  every row count, the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu as cpu_kernels

LANES = 16  # output channels per 64-byte load
PLAIN, GATED, GATED_SWIGLU = 0, 1, 2  # the kernel's modes (blocked_linear.c)


def available() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.strata_blocked_linear_available())


def available_f32() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.strata_blocked_linear_f32_available())


def f32_outruns_onednn() -> bool:
    """The fp32 path runs every call size about as fast as oneDNN's fp32 matmul or faster: an AVX2
    CPU without AVX-512, where oneDNN's kernels are 256 bits wide too (bench/blocked_linear.py
    --fp32 on a Zen 3: 1.5-2.5x at 1-4 rows, 0.97-1.25x at 64-2048 rows). Where AVX-512 is,
    oneDNN's 512-bit kernels win from about 96 rows (services/engine/linear.SMALL_CALL_ROWS)."""
    return available_f32() and not cpu_kernels.has_avx512f()


def bf16_exact(weight: torch.Tensor) -> bool:
    """An fp32 weight every value of which is a bf16 value (its low 16 bits zero): held as bf16,
    it loses nothing."""
    return weight.dtype == torch.float32 and not (weight.view(torch.int32) & 0xFFFF).any().item()


def packable(weight: torch.Tensor, swiglu: bool = False) -> bool:
    """A bf16 CPU weight [N, K] with K even (the kernel reads inputs in pairs); for swiglu, the
    gate and up halves whole blocks of 16 channels (N a multiple of 32)."""
    return (weight.dtype == torch.bfloat16 and _packable_shape(weight)
            and (not swiglu or weight.shape[0] % (2 * LANES) == 0))


def packable_as_bf16(weight: torch.Tensor) -> bool:
    """An fp32 CPU weight [N, K] with K even whose values are all bf16 values: its bf16 copy
    (`pack(weight.bfloat16())`) loses nothing, and runs fp32 activations."""
    return weight.dtype == torch.float32 and _packable_shape(weight) and bf16_exact(weight)


def _packable_shape(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.device.type == "cpu"
            and weight.shape[1] % 2 == 0 and weight.shape[1] > 0)


@dataclass
class BlockedWeight:
    words: torch.Tensor  # int32 [N padded / 16, K / 2, 16]: bf16 pairs
    bias: torch.Tensor | None  # fp32 [N padded]: the kernel's sums start there
    out_features: int
    in_features: int
    swiglu: bool = False  # a [gate; up] weight, its blocks interleaved (gate block i, up block i)

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False) -> BlockedWeight:
    """swiglu: `weight` is [gate; up] (SwiGLU's fused projection), laid out for `swiglu` too."""
    if not packable(weight, swiglu):
        need = "with K even" + (" and N a multiple of 32 (swiglu)" if swiglu else "")
        raise ValueError(f"a blocked weight is a bf16 CPU [N, K] {need}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    if swiglu:  # gate block i, then up block i: a tile holds both halves of the same channels
        weight = _interleave_halves(weight)
        bias = None if bias is None else _interleave_halves(bias)
    rows = -(-n // LANES) * LANES
    padded = weight if rows == n else torch.cat([weight, weight.new_zeros(rows - n, k)])
    words = cpu_kernels.huge_page_empty((rows // LANES, k // 2, LANES, 2), torch.bfloat16)
    words.copy_(padded.contiguous().view(rows // LANES, LANES, k // 2, 2).permute(0, 2, 1, 3))
    blocked_bias = None
    if bias is not None:
        blocked_bias = torch.zeros(rows, dtype=torch.float32)
        blocked_bias[:n] = bias.float()
    return BlockedWeight(words.view(torch.int32).view(rows // LANES, k // 2, LANES), blocked_bias, n, k, swiglu)


def _interleave_halves(t: torch.Tensor) -> torch.Tensor:
    """Rows [gate; up] -> gate block 0, up block 0, gate block 1, ... (blocks of LANES rows)."""
    blocks = t.shape[0] // (2 * LANES)
    return t.reshape(2, blocks, LANES, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def linear(x: torch.Tensor, weight: BlockedWeight) -> torch.Tensor:
    """x [..., K] bf16 (CPU) -> [..., N] bf16 (for a swiglu weight, [gate | up] as it came); or
    x fp32 -> [..., N] fp32 (a weight packed without swiglu)."""
    return _run(x, weight, GATED if weight.swiglu else PLAIN, weight.out_features)


def swiglu(x: torch.Tensor, weight: BlockedWeight) -> torch.Tensor:
    """x [..., K] bf16 (CPU) -> silu(x G^T) * (x U^T), [..., N / 2] bf16, for a weight packed with
    swiglu=True; the same bits as the element-wise kernel on `linear`'s output."""
    if not weight.swiglu:
        raise ValueError("swiglu needs a [gate; up] weight packed with swiglu=True")
    return _run(x, weight, GATED_SWIGLU, weight.out_features // 2)


def _run(x: torch.Tensor, weight: BlockedWeight, mode: int, width: int) -> torch.Tensor:
    fp32 = x.dtype == torch.float32 and mode == PLAIN
    if not (x.dtype == torch.bfloat16 or fp32) or x.device.type != "cpu":
        raise ValueError("a blocked linear takes bf16 CPU activations, or fp32 ones for a weight packed without "
                         f"swiglu; got {x.dtype} on {x.device}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"a blocked linear of {weight.in_features} inputs got {x.shape[-1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], width), dtype=x.dtype)
    if x2.shape[0]:
        lib = cpu_kernels.load()
        bias = None if weight.bias is None else weight.bias.data_ptr()
        args = (x2.data_ptr(), x2.shape[0], weight.in_features, x2.stride(0), weight.words.data_ptr(),
                weight.out_features, bias, out.data_ptr(), width, torch.get_num_threads())
        rc = lib.strata_blocked_linear_f32(*args) if fp32 else lib.strata_blocked_linear_bf16(*args, mode)
        if rc != 0:
            raise RuntimeError(f"blocked linear (CPU) failed with code {rc}")
    return out.view(*lead, width)
