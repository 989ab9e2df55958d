"""Weight-only quantized matmuls for the GPU: y = x W^T (+ bias) with W held as int8, int4 or fp8
e4m3, widened to x's dtype inside the tile loop (never a full-precision W in memory).

Layouts (``pack`` / ``pack_fp8`` make them from integers and scales):
  int8  ``data`` int8 [N, K]
  int4  ``data`` uint8 [N, K // 2]: byte j of row n holds W[n, 2j] in its low nibble and
        W[n, 2j + 1] in its high nibble, each stored as value + 8 (0..15)
  fp8   ``data`` the e4m3 bit patterns as uint8 [N, K]; decoded by bit arithmetic in the kernel,
        so it runs on every GPU (and under the interpreter); GPUs with fp8 tensor cores use
        torch._scaled_mm instead (services.engine.quantization.linear)
  ``scales`` fp32 [N, K // group_size] (group_size = K: one per output channel)

The kernel's K tile never straddles a scale group (BLOCK_K divides group_size), so each tile's
weights are integers times one scale per row: widen, scale, then tl.dot in fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import check_device, dot_in_fp32

MODE_INT8, MODE_INT4, MODE_FP8 = 0, 1, 2


@dataclass
class PackedQuantWeight:
    data: torch.Tensor
    scales: torch.Tensor  # fp32 [N, K // group_size]
    mode: int
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def weight(self) -> torch.Tensor:
        """fp8 only: the e4m3 weight as torch sees it (torch._scaled_mm reads it)."""
        return self.data.view(torch.float8_e4m3fn)


def pack(values: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> PackedQuantWeight:
    """values: int8 [N, K] integers (int4 ones in [-8, 7]); scales [N, K // group_size]."""
    n, k = values.shape
    if k % group_size or scales.shape != (n, k // group_size):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit a [{n}, {k}] weight in groups of {group_size}")
    if bits == 8:
        data = values.to(torch.int8).contiguous()
        mode = MODE_INT8
    elif bits == 4:
        if k % 2:
            raise ValueError("int4 weights need an even number of input channels")
        u = (values.to(torch.int16) + 8).to(torch.uint8).view(n, k // 2, 2)
        data = (u[..., 0] | (u[..., 1] << 4)).contiguous()
        mode = MODE_INT4
    else:
        raise ValueError(f"int weights are 4 or 8 bits, got {bits}")
    return PackedQuantWeight(data, scales.to(torch.float32).contiguous(), mode, group_size, n, k)


def pack_fp8(weight_fp8: torch.Tensor, scales: torch.Tensor) -> PackedQuantWeight:
    """weight_fp8: float8_e4m3fn [N, K]; scales: one per output channel ([N] or [N, 1])."""
    n, k = weight_fp8.shape
    if weight_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 weights must be float8_e4m3fn, got {weight_fp8.dtype}")
    return PackedQuantWeight(weight_fp8.contiguous().view(torch.uint8), scales.to(torch.float32).reshape(n, 1)
                             .contiguous(), MODE_FP8, k, n, k)


@triton.jit
def _e4m3_to_f32(bits):
    """e4m3fn bit patterns (uint8 as int32) to fp32: normals by building the fp32 bits, the
    subnormals (exponent 0) as mantissa * 2^-9. Weights hold no NaN."""
    sign = (bits >> 7) & 1
    exp = (bits >> 3) & 15
    man = bits & 7
    normal = ((exp + 120) << 23) | (man << 20)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    return tl.where(sign == 1, -mag, mag)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        rows = offs_n[:, None].to(tl.int64) * stride_wn
        if MODE == 0:  # int8
            w = tl.load(w_ptr + rows + ks[None, :], mask=w_mask, other=0).to(tl.float32)
        elif MODE == 1:  # int4: two per byte, stored + 8
            byte = tl.load(w_ptr + rows + (ks // 2)[None, :], mask=w_mask, other=0).to(tl.int32)
            w = (((byte >> ((ks % 2) * 4)[None, :]) & 15) - 8).to(tl.float32)
        else:  # fp8 e4m3 bit patterns
            w = _e4m3_to_f32(tl.load(w_ptr + rows + ks[None, :], mask=w_mask, other=0).to(tl.int32))
        scale = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + k0 // GROUP, mask=n_mask, other=0.0)
        w = w * scale[:, None]
        if FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_k(group_size: int, k: int) -> int:
    """The largest power of two <= 64 dividing the group (so a tile has one scale per row)."""
    block = 64
    while block > 16 and group_size % block:
        block //= 2
    if group_size % block:
        raise ValueError(f"group size {group_size} is not a multiple of 16")
    return block


def _matmul(x: torch.Tensor, w: PackedQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    check_device(x)
    if x.shape[-1] != w.in_features:
        raise ValueError(f"{x.shape[-1]} input features for a weight of {w.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, w.out_features), dtype=x.dtype, device=x.device)
    if m:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k = 64, _block_k(w.group_size, w.in_features)
        grid = (triton.cdiv(m, block_m), triton.cdiv(w.out_features, block_n))
        _quant_matmul_kernel[grid](
            x2, w.data, w.scales, bias if bias is not None else w.scales, y,
            m, w.out_features, w.in_features,
            x2.stride(0), w.data.stride(0), w.scales.stride(0), y.stride(0),
            GROUP=w.group_size, MODE=w.mode, HAS_BIAS=bias is not None, FP32=dot_in_fp32(x2),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
    return y.view(*lead, w.out_features)


def int_weight_matmul(x: torch.Tensor, w: PackedQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32/fp16/bf16) times an int8 or int4 packed weight: [..., N] in x's dtype."""
    if w.mode not in (MODE_INT8, MODE_INT4):
        raise ValueError("int_weight_matmul takes an int8 or int4 packed weight")
    return _matmul(x, w, bias)


def fp8_weight_matmul(x: torch.Tensor, w: PackedQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times an fp8 e4m3 weight with per-channel scales, widened in the tile loop."""
    if w.mode != MODE_FP8:
        raise ValueError("fp8_weight_matmul takes a weight from pack_fp8")
    return _matmul(x, w, bias)


def quant_matmul_ref(x: torch.Tensor, w: PackedQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize-then-matmul in fp32: the reference of the tests."""
    n, k = w.out_features, w.in_features
    if w.mode == MODE_INT8:
        values = w.data.to(torch.float32)
    elif w.mode == MODE_INT4:
        d = w.data.to(torch.int16)
        values = torch.stack([(d & 15) - 8, (d >> 4) - 8], dim=-1).view(n, k).to(torch.float32)
    else:
        values = w.weight.to(torch.float32)
    dense = (values.view(n, k // w.group_size, w.group_size) * w.scales[..., None]).view(n, k)
    out = x.to(torch.float32) @ dense.t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
