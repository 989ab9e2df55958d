"""Linear layers whose weights stay quantized into the matmul: the same interface as
services.engine.linear.Linear (`__call__(x)`, `nbytes`, `weight` None: no full-precision matrix
is held).

    CPU   int8 / int4: kernels/cpu/quant_linear.c reads the packed integers (kernels.cpu.quant)
    CUDA  int8 / int4: the Triton GEMM of kernels.quant_matmul, dequantizing inside its tile loop;
          fp8 (e4m3, a scale per output channel): torch._scaled_mm with per-token fp8 activations
          where the GPU has fp8 tensor cores (compute capability 8.9+), else the Triton kernel
          with fp8 weights widened in its tile loop
"""

from __future__ import annotations

import torch

from services.engine.quantization.weights import QuantizedWeight

FP8_MAX = 448.0  # largest finite e4m3 value


class QuantizedLinear:
    """int8 or int4 weight-only: y = x (values * scales)^T + bias, x in the model's dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.dtype, self.device = dtype, torch.device(device)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype).contiguous()
        self.weight = None  # never a full-precision copy
        if self.device.type == "cpu":
            from kernels.cpu import quant as cpu_quant

            self.packed = cpu_quant.pack(weight.values, weight.scales, weight.bits, weight.group_size)
            self._matmul = lambda x: cpu_quant.qlinear(x, self.packed, self.bias)
        else:
            from kernels import quant_matmul

            self.packed = quant_matmul.pack(weight.values.to(self.device), weight.scales.to(self.device),
                                            weight.bits, weight.group_size)
            self._matmul = lambda x: quant_matmul.int_weight_matmul(x, self.packed, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    @property
    def nbytes(self) -> int:
        """Bytes the packed integers, their scales and the bias occupy."""
        return self.packed.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


class Fp8Linear:
    """fp8 e4m3 weights with one fp32 scale per output channel (CUDA only)."""

    def __init__(self, weight_fp8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"quantization=fp8 runs on CUDA only, not on {self.device}")
        from kernels import quant_matmul

        self.out_features, self.in_features = weight_fp8.shape
        self.dtype = dtype
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype).contiguous()
        self.weight = None
        self.packed = quant_matmul.pack_fp8(weight_fp8.to(self.device), scales.to(self.device))
        major, minor = torch.cuda.get_device_capability(self.device)
        self.scaled_mm = (major, minor) >= (8, 9)  # fp8 tensor cores
        self._quant_matmul = quant_matmul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.scaled_mm:
            return self._quant_matmul.fp8_weight_matmul(x, self.packed, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        # Per-token dynamic activation scales, as vLLM's fp8 path does.
        x_scale = (x2.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        x_fp8 = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(x_fp8, self.packed.weight.t(), scale_a=x_scale,
                               scale_b=self.packed.scales.view(1, -1), bias=self.bias, out_dtype=self.dtype)
        return out.view(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
