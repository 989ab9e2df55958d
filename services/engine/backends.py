"""Device backends: the few ops the model needs, in plain torch or as Triton kernels.

The engine picks Triton on CUDA and torch elsewhere; both read the same KV cache layout
(see services.engine.attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels
from services.engine.attention import TorchAttention
from kernels.reference import rotary_embedding_ref


class TorchOps:
    """Plain torch, except that on CPU (fp32, bf16) the element-wise ops run as the one-pass C
    kernels of kernels.cpu, which compute the same thing (tests/engine/test_cpu_layer_ops.py)."""

    name = "torch"
    attention_cls = TorchAttention

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm as Hugging Face computes it; with residual, adds it first and returns both
        (the C path updates `residual` in place)."""
        if cpu_kernels.supports(x, weight, residual):
            normed = cpu_kernels.rms_norm(x, weight, eps, residual)
            return normed if residual is None else (normed, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # one fused op; same math as below
            normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
        else:
            xf = x.float()
            normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return normed if residual is None else (normed, residual)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.supports(x):
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(positions, q, k, cos_sin_cache, head_dim):
        """NeoX rotary embedding; returns (q, k) (the C path rotates them in place)."""
        if cpu_kernels.supports(q, k) and q.dim() == 3 and q.stride(1) == head_dim == k.stride(1):
            cpu_kernels.rotary(positions, q, k, cos_sin_cache)
            return q, k
        return rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim)


def select_ops(device: torch.device, backend: str = "auto"):
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return TorchOps
    if backend == "triton":
        from services.engine.triton_backend import TritonOps  # imports triton: only when chosen
        return TritonOps
    raise ValueError(f"unknown attention backend {backend!r} (auto, torch, triton)")
