"""Small launch-side helpers shared by the kernel modules.

Kept tiny on purpose: launchers run every engine step, so nothing here may
synchronize with the GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(x_ptr):
    tl.store(x_ptr, 0)


# triton.jit picks the interpreter at decoration time (TRITON_INTERPRET=1 when
# this module is first imported), so inspect what we actually got instead of
# re-reading the environment, which may have changed since.
INTERPRETED: bool = type(_probe_kernel).__name__ == "InterpretedFunction"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def check_device(t: torch.Tensor) -> None:
    """Fail loudly instead of handing CPU pointers to a compiled GPU kernel."""
    if t.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"strata kernels got a tensor on {t.device}; compiled Triton kernels need CUDA "
            "tensors. For CPU, set TRITON_INTERPRET=1 before `kernels` (and triton) is imported."
        )


def dot_in_fp32(t: torch.Tensor) -> bool:
    """Whether tl.dot should run on fp32 operands with IEEE precision.

    True for fp32 inputs (tf32 would lose ~3 decimal digits) and always on the
    interpreter, whose tl.dot returns garbage for bf16 operands (seen with
    triton 3.9); 16-bit operands on the GPU use the tensor cores directly.
    """
    return t.dtype == torch.float32 or t.device.type != "cuda"


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(idx)
    # Interpreter: a small pretend machine so the split heuristic still splits.
    return 8
