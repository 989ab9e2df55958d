"""Weight-only int8/int4 linear layers on CPU: the packed layout and the call into
kernels/cpu/quant_linear.c (see its header for the layout and the arithmetic).

`pack` turns integers and scales into the kernel's layout once, at load; `qlinear` runs
y = x W^T (+ bias) reading the packed integers, fp32 or bf16 in and out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu as cpu_kernels

LANES = 16  # output channels per 64-byte load
ROW_MULTIPLE = 64  # rows padded to whole work items of the kernel (4 blocks of 16)


@dataclass
class PackedWeight:
    words: torch.Tensor  # int32 [rows_padded / 16, in / (32 / bits), 16]
    scales: torch.Tensor  # fp32 [rows_padded / 16, in / group_size, 16]
    bits: int
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() * 4


def pack(values: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> PackedWeight:
    """values: int8 [out, in] integers (int4 ones in [-8, 7]); scales: [out, in // group_size]."""
    if bits not in (4, 8):
        raise ValueError(f"packed weights are 4 or 8 bits, got {bits}")
    n, k = values.shape
    per_word = 32 // bits
    if k % group_size or group_size % per_word or scales.shape != (n, k // group_size):
        raise ValueError(f"cannot pack a [{n}, {k}] {bits}-bit weight in groups of {group_size} "
                         f"with scales {tuple(scales.shape)}")
    rows = -(-n // ROW_MULTIPLE) * ROW_MULTIPLE
    padded = torch.zeros((rows, k), dtype=torch.int64)
    padded[:n] = values.to(torch.int64) & ((1 << bits) - 1)  # two's complement bits of each value
    fields = padded.view(rows // LANES, LANES, k // per_word, per_word).permute(0, 2, 1, 3)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (fields << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()
    blocked = torch.zeros((rows, k // group_size), dtype=torch.float32)
    blocked[:n] = scales.to(torch.float32)
    blocked = blocked.view(rows // LANES, LANES, k // group_size).permute(0, 2, 1).contiguous()
    return PackedWeight(words, blocked, bits, group_size, n, k)


def qlinear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] fp32 or bf16 (CPU) -> [..., out] in x's dtype."""
    lib = cpu_kernels.load()
    if lib is None:
        raise RuntimeError("CPU kernels unavailable (no C compiler)")
    if x.dtype not in cpu_kernels.KERNEL_DTYPES or x.device.type != "cpu":
        raise ValueError(f"qlinear takes fp32 or bf16 CPU activations, got {x.dtype} on {x.device}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"qlinear: {x.shape[-1]} input features for a weight of {weight.in_features}")
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError("qlinear: the bias must be contiguous and of the activations' dtype")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.in_features).contiguous()
    out = torch.empty((x2.shape[0], weight.out_features), dtype=x.dtype)
    if x2.shape[0]:
        rc = getattr(lib, f"strata_qlinear_{cpu_kernels.KERNEL_DTYPES[x.dtype]}")(
            x2.data_ptr(), x2.shape[0], weight.in_features, weight.words.data_ptr(), weight.bits,
            weight.scales.data_ptr(), weight.group_size, weight.out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), weight.out_features, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"qlinear (CPU) failed with code {rc}")
    return out.view(*lead, weight.out_features)
