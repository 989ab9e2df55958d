"""A weight's integers and scales, as quantize-on-load makes them and compressed-tensors
checkpoints store them.

The arithmetic is compressed-tensors' own (calculate_qparams for the scales from each channel's
or group's min and max, then its quantize), so a model quantized on load holds exactly what
llm-compressor's weight-only schemes would have saved from the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # compressed-tensors is imported where it is used: it costs seconds at every engine start
    from compressed_tensors.quantization import QuantizationArgs

INT4_GROUP_SIZE = 128


def scheme_args(name: str) -> QuantizationArgs:
    """The weight scheme of `quantization=name` for quantize-on-load (symmetric, static)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType

    if name == "int8":
        return QuantizationArgs(num_bits=8, type=QuantizationType.INT, strategy=QuantizationStrategy.CHANNEL,
                                symmetric=True)
    if name == "int4":
        return QuantizationArgs(num_bits=4, type=QuantizationType.INT, strategy=QuantizationStrategy.GROUP,
                                group_size=INT4_GROUP_SIZE, symmetric=True)
    raise ValueError(f"no integer weight scheme named {name!r}")


@dataclass
class QuantizedWeight:
    """W ~= values * scales, one scale per group of `group_size` input channels (group_size =
    in_features: one per output channel)."""

    values: torch.Tensor  # int8 [out, in]: the integers (int4 ones in [-8, 7])
    scales: torch.Tensor  # [out, in // group_size]
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full-precision matrix: the reference the kernels are tested against (never held)."""
        n, k = self.shape
        groups = self.values.view(n, k // self.group_size, self.group_size).to(torch.float32)
        return (groups * self.scales.to(torch.float32)[..., None]).view(n, k).to(dtype)


def check_shape(n: int, k: int, bits: int, group_size: int, where: str) -> None:
    """The kernels' conditions: groups tile the row; a 32-bit word holds 32/bits whole values."""
    if k % group_size or group_size % (32 // bits):
        raise ValueError(f"{where}: {bits}-bit weights of {k} input channels in groups of {group_size} are not "
                         f"supported (the group size must divide the input channels and be a multiple of "
                         f"{32 // bits})")


def quantize(weight: torch.Tensor, args: QuantizationArgs, where: str = "weight") -> QuantizedWeight:
    """Quantize a [out, in] weight as compressed-tensors does (static min/max observer)."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = weight.shape
    if args.strategy == QuantizationStrategy.GROUP:
        group = args.group_size
        check_shape(n, k, args.num_bits, group, where)
        grouped = weight.view(n, k // group, group)
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == QuantizationStrategy.CHANNEL:
        group = k
        check_shape(n, k, args.num_bits, group, where)
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        raise ValueError(f"{where}: weight strategy {args.strategy!r} is not supported (channel or group)")
    scale, zero_point = calculate_qparams(low, high, args)
    values = ct_quantize(x=weight, scale=scale, zero_point=zero_point, args=args, dtype=torch.int8)
    return QuantizedWeight(values, scale.view(n, k // group), args.num_bits, group)


def quantize_fp8(weight: torch.Tensor, where: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weights with one scale per output channel (compressed-tensors' FP8 weights):
    (float8_e4m3fn [out, in], fp32 scales [out])."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.CHANNEL,
                            symmetric=True)
    if weight.dim() != 2:
        raise ValueError(f"{where}: fp8 quantization takes a 2-D weight")
    scale, zero_point = calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), args)
    values = ct_quantize(x=weight, scale=scale, zero_point=zero_point, args=args, dtype=torch.float8_e4m3fn)
    return values, scale.view(-1).to(torch.float32)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused projections (q/k/v, gate/up): the parts' rows one after another."""
    first = parts[0]
    if any((p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1]) for p in parts):
        raise ValueError("fused projections must share bits, group size and input channels")
    if len(parts) == 1:
        return first
    return QuantizedWeight(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]),
                           first.bits, first.group_size)
