"""Gathered LoRA matmuls (BGMV, as Punica and vLLM call them): every token applies the adapter
in its own slot, so one launch serves a batch that mixes the base model and many adapters.

Layout (services.engine.lora.adapter): per fused linear, the device holds
`a_stack` [slots, n_slices * R, in] and `b_stack` [slots, n_slices * R, out] (block-diagonal
per slice, scaling folded in). `token_slots` [tokens] int32 is each token's slot, -1 for the
base model (no delta).

- shrink: y[t] = a_stack[slot[t]] @ x[t]            -> y [tokens, n_slices * R] fp32
- expand: out[t] += y[t] @ b_stack[slot[t]]         (in place, in out's dtype)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_device, next_pow2


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, y_ptr,
    K, N,
    stride_x, stride_al, stride_an, stride_y,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_al + offs_n[:, None] * stride_an + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(y_ptr + t * stride_y + offs_n, acc, mask=offs_n < N)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, b_ptr, slot_ptr, out_ptr,
    R, N,
    stride_y, stride_bl, stride_br, stride_o,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        y = tl.load(y_ptr + t * stride_y + offs_r, mask=offs_r < R, other=0.0)
        b = tl.load(b_ptr + slot * stride_bl + offs_r[:, None] * stride_br + offs_n[None, :],
                    mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
        delta = tl.sum(b * y[:, None], axis=0)
        o = tl.load(out_ptr + t * stride_o + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + offs_n, (o + delta).to(out_ptr.dtype.element_ty), mask=offs_n < N)


def bgmv_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [tokens, n_slices * R] fp32: each token's x times its slot's A (zero for slot -1)."""
    check_device(x)
    tokens, k = x.shape
    n = a_stack.shape[1]
    assert a_stack.shape[2] == k and a_stack.stride(2) == 1 and x.stride(1) == 1
    y = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    if tokens:
        block_n = min(next_pow2(n), 64)
        _bgmv_shrink_kernel[(tokens, triton.cdiv(n, block_n))](
            x, a_stack, token_slots, y, k, n, x.stride(0), a_stack.stride(0), a_stack.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_K=min(next_pow2(k), 128))
    return y


def bgmv_expand(y: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t] += y[t] @ b_stack[slot[t]] in place (tokens of slot -1 unchanged); returns out."""
    check_device(out)
    tokens, n = out.shape
    r = b_stack.shape[1]
    assert b_stack.shape[2] == n and b_stack.stride(2) == 1 and out.stride(1) == 1 and y.shape == (tokens, r)
    if tokens:
        block_n = 64
        _bgmv_expand_kernel[(tokens, triton.cdiv(n, block_n))](
            y, b_stack, token_slots, out, r, n, y.stride(0), b_stack.stride(0), b_stack.stride(1), out.stride(0),
            BLOCK_N=block_n, BLOCK_R=next_pow2(r))
    return out


def lora_delta_ref(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                   token_slots: torch.Tensor) -> torch.Tensor:
    """The delta every token gets, in fp32, one token at a time: the reference of both kernels."""
    out = torch.zeros((x.shape[0], b_stack.shape[2]), dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] = (a_stack[slot].float() @ x[t].float()) @ b_stack[slot].float()
    return out
