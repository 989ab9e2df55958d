"""RMSNorm, optionally fused with the residual add (Llama pre-norm stream)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_device, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual dtype first: the stored stream and the
        # value we normalize are then exactly what an unfused add would give.
        new_res = (h + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, new_res, mask=mask)
        h = new_res.to(tl.float32)
    var = tl.sum(h * h, 0) / hidden
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of ``x [num_tokens, hidden]`` in fp32.

    Without ``residual``: returns ``x_normed * weight`` in x's dtype.
    With ``residual``: returns ``(normed, new_residual)`` where
    ``new_residual = x + residual`` (in the residual's dtype) and
    ``normed = rmsnorm(new_residual) * weight`` (vLLM fused_add_rms_norm
    semantics). Inputs are never modified; outputs are new tensors.
    """
    check_device(x)
    shape = x.shape
    hidden = shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty((n, hidden), dtype=residual.dtype, device=x.device)
    else:
        r2 = res_out = x2  # unused placeholders
    if n > 0:
        block = next_pow2(hidden)
        _rms_norm_kernel[(n,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RES=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(residual.shape)
