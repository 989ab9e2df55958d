"""bf16 linear layers on CPUs with AVX512-BF16: the blocked weight layout and the call into
kernels/cpu/blocked_linear.c (see its header for the layout, the tiles and why).

`pack` lays a weight out once, at load; `linear` runs y = x W^T (+ bias) on it. `available`
says whether this CPU and build run it (else callers keep oneDNN's packed matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu as cpu_kernels

LANES = 16  # output channels per 64-byte load


def available() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.strata_blocked_linear_available())


def packable(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight [N, K] with K even (the kernel reads inputs in pairs)."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % 2 == 0 and weight.shape[1] > 0)


@dataclass
class BlockedWeight:
    words: torch.Tensor  # int32 [N padded / 16, K / 2, 16]: bf16 pairs
    bias: torch.Tensor | None  # fp32 [N padded]: the kernel's sums start there
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockedWeight:
    if not packable(weight):
        raise ValueError(f"a blocked weight is a bf16 CPU [N, K] with K even, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    rows = -(-n // LANES) * LANES
    padded = weight if rows == n else torch.cat([weight, weight.new_zeros(rows - n, k)])
    words = cpu_kernels.huge_page_empty((rows // LANES, k // 2, LANES, 2), torch.bfloat16)
    words.copy_(padded.contiguous().view(rows // LANES, LANES, k // 2, 2).permute(0, 2, 1, 3))
    blocked_bias = None
    if bias is not None:
        blocked_bias = torch.zeros(rows, dtype=torch.float32)
        blocked_bias[:n] = bias.float()
    return BlockedWeight(words.view(torch.int32).view(rows // LANES, k // 2, LANES), blocked_bias, n, k)


def linear(x: torch.Tensor, weight: BlockedWeight) -> torch.Tensor:
    """x [..., K] bf16 (CPU) -> [..., N] bf16."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"a blocked linear takes bf16 CPU activations, got {x.dtype} on {x.device}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"a blocked linear of {weight.in_features} inputs got {x.shape[-1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], weight.out_features), dtype=torch.bfloat16)
    if x2.shape[0]:
        rc = cpu_kernels.load().strata_blocked_linear_bf16(
            x2.data_ptr(), x2.shape[0], weight.in_features, x2.stride(0), weight.words.data_ptr(),
            weight.out_features, None if weight.bias is None else weight.bias.data_ptr(), out.data_ptr(),
            weight.out_features, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"blocked linear (CPU) failed with code {rc}")
    return out.view(*lead, weight.out_features)
