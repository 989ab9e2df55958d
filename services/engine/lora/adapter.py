"""PEFT LoRA adapters: checked against the base model without loading them, then loaded into
the layout the engine's fused linear layers use.

An adapter directory is what PEFT's `save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors`. Each targeted projection has `lora_A` [r, in] and `lora_B`
[out, r]; the delta of a projection is `scaling * x @ A.T @ B.T` with scaling `lora_alpha / r`
(or `lora_alpha / sqrt(r)` with rsLoRA).

The engine fuses q/k/v into one `qkv` linear and gate/up into `gate_up`; an adapter is held per
(layer, fused linear) as two matrices sized for the engine's max_lora_rank R:
`A` [n_slices * R, in] (slice i's A in rows i*R..) and `B` [n_slices * R, out] (slice i's B.T,
scaled, in rows i*R.. and the slice's own output columns: block-diagonal). So one shrink
(x @ A.T) and one expand (y @ B) apply every projection of a fused linear, whatever the
adapter targets; untargeted slices are zero.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (the engine's fused linear, slice index in it).
MODULE_SLICES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
                 "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
SUPPORTED_MODULES = tuple(MODULE_SLICES)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[A-Za-z0-9_]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot serve on this base model; the message says why."""


def linear_slices(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Fused linear -> (in features, output size of each slice), as model.LlamaModel builds them."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv": (c.hidden_size, [q, kv, kv]), "o": (q, [c.hidden_size]),
            "gate_up": (c.hidden_size, [c.intermediate_size, c.intermediate_size]),
            "down": (c.intermediate_size, [c.hidden_size])}


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of one PEFT-targetable projection of the base model."""
    linear, i = MODULE_SLICES[module]
    fan_in, outs = linear_slices(config)[linear]
    return fan_in, outs[i]


@dataclass
class AdapterInfo:
    """What checking an adapter found: enough to refuse it or to load it."""

    path: Path
    rank: int
    scaling: float
    modules: list[str]  # PEFT modules it targets
    tensors: dict[tuple[int, str, str], str] = field(default_factory=dict)  # (layer, module, A|B) -> key
    nbytes: int = 0


def inspect_adapter(path: str | Path, config: ModelConfig, max_lora_rank: int) -> AdapterInfo:
    """Check an adapter against the base model and the engine's rank limit, reading only its
    config and the safetensors header. Raises LoRAAdapterError naming the problem."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise LoRAAdapterError(f"adapter path {path} does not exist or is not a directory")
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file():
        raise LoRAAdapterError(f"{path}: missing {CONFIG_FILE}")
    if not weights.is_file():
        other = " (only safetensors adapters are read, not adapter_model.bin)" if (path / "adapter_model.bin").exists() \
            else ""
        raise LoRAAdapterError(f"{path}: missing {WEIGHTS_FILE}{other}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, OSError) as exc:
        raise LoRAAdapterError(f"{path}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{path}: {CONFIG_FILE} must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{path}: rank {rank} is above this engine's max_lora_rank {max_lora_rank}")
    unsupported = [(k, cfg.get(k)) for k in ("use_dora", "fan_in_fan_out") if cfg.get(k)]
    unsupported += [(k, cfg.get(k)) for k in ("modules_to_save", "rank_pattern", "alpha_pattern", "trainable_token_indices")
                    if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(("bias", cfg.get("bias")))
    if unsupported:
        raise LoRAAdapterError(f"{path}: unsupported adapter settings: "
                               + ", ".join(f"{k}={v!r}" for k, v in unsupported))
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(SUPPORTED_MODULES))
        if bad:
            raise LoRAAdapterError(f"{path}: target modules {bad} are not supported "
                                   f"(supported: {', '.join(SUPPORTED_MODULES)})")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    info = AdapterInfo(path, rank, scaling, [])
    try:
        handle = safe_open(str(weights), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise LoRAAdapterError(f"{path}: {WEIGHTS_FILE} cannot be read: {exc}") from None
    modules: set[str] = set()
    for key in handle.keys():
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULE_SLICES:
            raise LoRAAdapterError(f"{path}: tensor {key!r} is not a LoRA weight of a supported projection "
                                   f"({', '.join(SUPPORTED_MODULES)})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= config.num_layers:
            raise LoRAAdapterError(f"{path}: tensor {key!r} is for layer {layer}, but the base model has "
                                   f"{config.num_layers} layers")
        fan_in, fan_out = module_shape(config, module)
        want = [rank, fan_in] if which == "A" else [fan_out, rank]
        shape = list(handle.get_slice(key).get_shape())
        if shape != want:
            raise LoRAAdapterError(f"{path}: tensor {key!r} has shape {shape}, but this base model needs {want} "
                                   f"(an adapter trained for another base model?)")
        info.tensors[(layer, module, which)] = key
        info.nbytes += math.prod(shape) * 2
        modules.add(module)
    if not info.tensors:
        raise LoRAAdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    for layer, module, which in list(info.tensors):
        if (layer, module, "B" if which == "A" else "A") not in info.tensors:
            raise LoRAAdapterError(f"{path}: layer {layer} {module} has lora_{which} but not its pair")
    info.modules = sorted(modules)
    return info


@dataclass
class LoRAWeights:
    """One adapter in the engine's layout (see the module docstring), on the host."""

    name: str
    info: AdapterInfo
    # (layer, fused linear) -> (A [n_slices * R, in], B [n_slices * R, out]); absent: untargeted.
    linears: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.linears.values())


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_lora_rank: int,
                 dtype: torch.dtype) -> LoRAWeights:
    """Check, then read an adapter into padded, scaled, fused matrices of `dtype` (on the host)."""
    from safetensors import safe_open

    info = inspect_adapter(path, config, max_lora_rank)
    slices = linear_slices(config)
    R = max_lora_rank
    linears: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as handle:
        for (layer, module, which), key in sorted(info.tensors.items()):
            if which != "A":
                continue
            linear, i = MODULE_SLICES[module]
            fan_in, outs = slices[linear]
            if (layer, linear) not in linears:
                n = len(outs)
                linears[(layer, linear)] = (torch.zeros(n * R, fan_in, dtype=dtype),
                                            torch.zeros(n * R, sum(outs), dtype=dtype))
            a_all, b_all = linears[(layer, linear)]
            lora_a = handle.get_tensor(key).float()  # [r, in]
            lora_b = handle.get_tensor(info.tensors[(layer, module, "B")]).float()  # [out, r]
            start = sum(outs[:i])
            a_all[i * R:i * R + info.rank].copy_(lora_a)
            # The scaling is folded into B in fp32, before rounding to the engine's dtype.
            b_all[i * R:i * R + info.rank, start:start + outs[i]].copy_((lora_b * info.scaling).t())
    return LoRAWeights(name, info, linears)
