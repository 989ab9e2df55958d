"""Checkpoints already quantized: config.json's `quantization_config` in the compressed-tensors
format (as llm-compressor saves it), read with the compressed-tensors package.

Supported: integer weight-only schemes (W8A16, W4A16: int8 or int4, symmetric, per channel, per
group or per tensor) stored pack-quantized (values packed into int32, `weight_packed`) or
naive-quantized (int8 `weight`), with `weight_scale`. Anything else (another quant_method,
float-quantized fp8, activation quantization, zero points, activation ordering, quantized
modules other than the decoder's linear layers) is refused at load, naming what it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.quantization.weights import QuantizedWeight, check_shape

QUANT_METHOD = "compressed-tensors"
SUPPORTED_FORMATS = ("pack-quantized", "naive-quantized")
# Modules the decoder reads as linear layers (Llama/Qwen names); anything else quantized is refused.
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def quantization_config(model_dir: str | Path) -> dict | None:
    """config.json's quantization_config, or None."""
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()).get("quantization_config") if path.exists() else None


@dataclass
class Scheme:
    """One config group's weight scheme, as the kernels take it."""

    bits: int
    group_size: int | None  # None: one scale per output channel (or per tensor, broadcast)
    format: str


class CompressedTensorsCheckpoint:
    """Which projection of a compressed-tensors checkpoint is quantized how; reads them."""

    def __init__(self, model_dir: str | Path, raw: dict):
        from compressed_tensors.quantization import QuantizationConfig

        self.path = Path(model_dir)
        try:
            self.config = QuantizationConfig.model_validate(raw)
        except Exception as exc:  # pydantic's error names the bad field
            raise ValueError(f"{self.path}: quantization_config is not a valid compressed-tensors config: {exc}") \
                from None
        default_format = self.config.format
        self.groups: list[tuple[list[str], Scheme]] = []
        for name, group in self.config.config_groups.items():
            where = f"{self.path}: quantization_config.config_groups.{name}"
            self.groups.append((list(group.targets), _scheme(group, default_format, where)))
        if self.config.kv_cache_scheme is not None:
            raise ValueError(f"{self.path}: quantization_config.kv_cache_scheme is not supported "
                             f"(use the engine argument kv_cache_dtype)")
        self.bits = sorted({scheme.bits for _, scheme in self.groups})

    @property
    def name(self) -> str:
        """The engine's quantization name for what the checkpoint holds: int8, int4 (or both)."""
        return ",".join(f"int{b}" for b in sorted(self.bits, reverse=True))

    def scheme_of(self, module: str) -> Scheme | None:
        """The scheme of a Linear module (its name as the checkpoint spells it), or None if it is
        not quantized."""
        from compressed_tensors.utils.match import is_match

        probe = _linear_probe()
        for targets, scheme in self.groups:
            if is_match(module, probe, targets, self.config.ignore or []):
                return scheme
        return None

    def load(self, ckpt, module: str, scheme: Scheme) -> QuantizedWeight:
        """One module's integers and scales (ckpt: services.engine.checkpoint.Checkpoint)."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        where = f"{self.path}: {module}"
        for extra in ("weight_zero_point", "weight_g_idx"):
            if ckpt.has(f"{module}.{extra}"):
                raise ValueError(f"{where}: {extra} is not supported (symmetric weights without activation "
                                 f"ordering only)")
        scale = ckpt.get(f"{module}.weight_scale")
        if scheme.format == "pack-quantized":
            shape = [int(v) for v in ckpt.get(f"{module}.weight_shape").tolist()]
            values = unpack_from_int32(ckpt.get(f"{module}.weight_packed"), scheme.bits, torch.Size(shape))
        else:
            values = ckpt.get(f"{module}.weight")
            if values.dtype != torch.int8:
                raise ValueError(f"{where}: naive-quantized weight is {values.dtype}, expected int8")
        n, k = values.shape
        if scale.numel() == 1:  # per tensor: the same scale for every channel
            scale = scale.reshape(1, 1).expand(n, 1)
        scale = scale.reshape(n, -1)
        group = k // scale.shape[1]
        if group * scale.shape[1] != k or (scheme.group_size is not None and scheme.group_size != group):
            raise ValueError(f"{where}: weight_scale of shape {tuple(scale.shape)} does not fit a [{n}, {k}] weight")
        check_shape(n, k, scheme.bits, group, where)
        return QuantizedWeight(values.contiguous(), scale.contiguous(), scheme.bits, group)

    def check_modules(self, names: list[str]) -> None:
        """Refuse a checkpoint with quantized tensors the decoder would not read as linear layers."""
        quantized = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith((".weight_scale", ".weight_packed"))})
        others = [m for m in quantized if not m.endswith(LINEAR_SUFFIXES)]
        if others:
            raise ValueError(f"{self.path}: quantized modules {', '.join(others[:3])} are not linear layers of the "
                             f"decoder (only {', '.join(LINEAR_SUFFIXES)} may be quantized)")


def _scheme(group, default_format: str | None, where: str) -> Scheme:
    weights = group.weights
    fmt = group.format or default_format
    if group.input_activations is not None or group.output_activations is not None:
        raise ValueError(f"{where}: activation quantization is not supported (weight-only schemes: W8A16, W4A16)")
    if weights is None:
        raise ValueError(f"{where}: no weight scheme")
    if fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"{where}: format {fmt!r} is not supported (supported: {', '.join(SUPPORTED_FORMATS)} "
                         f"integer weights)")
    if weights.type != "int" or weights.num_bits not in (4, 8):
        raise ValueError(f"{where}: {weights.type} {weights.num_bits}-bit weights are not supported (int8, int4)")
    if fmt == "naive-quantized" and weights.num_bits != 8:
        raise ValueError(f"{where}: naive-quantized {weights.num_bits}-bit weights are not supported")
    if not weights.symmetric:
        raise ValueError(f"{where}: asymmetric weights (zero points) are not supported")
    if weights.actorder:
        raise ValueError(f"{where}: activation ordering (actorder={weights.actorder}) is not supported")
    if weights.strategy not in ("channel", "group", "tensor"):
        raise ValueError(f"{where}: weight strategy {weights.strategy!r} is not supported (channel, group, tensor)")
    return Scheme(weights.num_bits, weights.group_size if weights.strategy == "group" else None, fmt)


_PROBE: torch.nn.Module | None = None


def _linear_probe() -> torch.nn.Module:
    """A Linear module for compressed-tensors' matcher: targets name module classes ("Linear")
    as well as names and regexes, and every module asked about here is a Linear."""
    global _PROBE
    if _PROBE is None:
        _PROBE = torch.nn.Linear(1, 1, bias=False, device="meta")
    return _PROBE


def describe(raw: dict) -> str:
    """A quantization_config in a few words, for errors."""
    method = raw.get("quant_method", "?")
    fmt = raw.get("format")
    return f"quant_method {method!r}" + (f", format {fmt!r}" if fmt else "")


def is_compressed_tensors(raw: dict) -> bool:
    return raw.get("quant_method") == QUANT_METHOD

