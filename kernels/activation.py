"""SwiGLU gate: silu(gate) * up on the fused [gate | up] projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_device


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    # silu(a) = a * sigmoid(a); exp(-a) -> inf for very negative a gives -0, fine.
    y = a / (1.0 + tl.exp(-a)) * b
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2*d] -> silu(x[..., :d]) * x[..., d:]`` (fp32 math, x's dtype out)."""
    check_device(x)
    two_d = x.shape[-1]
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n > 0 and d > 0:
        _silu_and_mul_kernel[(n, triton.cdiv(d, _BLOCK))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=_BLOCK, num_warps=4
        )
    return out.view(*x.shape[:-1], d)
