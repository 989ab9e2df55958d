"""Which quantization a model runs, and the loader of its projections.

`resolve` decides from the engine argument and the checkpoint's config.json:
  - a compressed-tensors checkpoint runs as it was saved (int8/int4 weight-only); asking for
    another quantization of it is an error;
  - any other quantization_config (GPTQ, AWQ, bitsandbytes, fp8 checkpoints, ...) is refused,
    naming its quant_method and format;
  - otherwise `quantization` (int8, int4, fp8) quantizes the fp32/fp16/bf16 weights on load, one
    projection at a time (the full-precision tensor is dropped as soon as it is quantized).

The decoder layers' projections are quantized; the embedding, the norms and the lm_head stay in
the model's dtype unless a checkpoint stores its lm_head quantized (llm-compressor's recipes
leave lm_head out: its error lands straight on the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.quantization import compressed
from services.engine.quantization.support import NOT_QUANTIZED

LM_HEAD = "lm_head"


@dataclass
class QuantizationPlan:
    name: str  # "none", "int8", "int4", "fp8" (what the replica reports)
    source: str  # "none", "on-load" or "checkpoint"
    checkpoint: compressed.CompressedTensorsCheckpoint | None = None


def resolve(requested: str | None, model_dir: str | Path) -> QuantizationPlan:
    raw = compressed.quantization_config(model_dir)
    if raw is not None:
        if not compressed.is_compressed_tensors(raw):
            raise ValueError(f"{model_dir}: checkpoint quantization ({compressed.describe(raw)}) is not supported: "
                             f"only compressed-tensors int8/int4 weight-only checkpoints load (or quantize an "
                             f"unquantized checkpoint on load with quantization=int8/int4)")
        ct = compressed.CompressedTensorsCheckpoint(model_dir, raw)
        if requested is not None and requested != ct.name:
            raise ValueError(f"quantization: the checkpoint is already quantized ({ct.name}, compressed-tensors); "
                             f"it cannot run as {requested} (leave quantization unset)")
        return QuantizationPlan(ct.name, "checkpoint", ct)
    if requested is None:
        return QuantizationPlan(NOT_QUANTIZED, "none")
    return QuantizationPlan(requested, "on-load")


def linear_loader(plan: QuantizationPlan):
    """The projection loader for LlamaModel: dense without quantization."""
    from services.engine.model import dense_linear

    return dense_linear if plan.source == "none" else QuantizedLinearLoader(plan)


class QuantizedLinearLoader:
    """model.dense_linear's signature: (ckpt, modules, dtype, device, bias, swiglu) -> a
    Linear-like. `swiglu` lets a kernel fuse the activation and never changes results: quantized
    kernels do not fuse it, and what this loader keeps dense loads unfused."""

    def __init__(self, plan: QuantizationPlan):
        self.plan = plan
        self._checked = False
        self._has_prefix: bool | None = None

    def __call__(self, ckpt, modules: list[str], dtype: torch.dtype, device: torch.device, bias: bool = False,
                 swiglu: bool = False):
        from services.engine.model import dense_linear

        if self.plan.source == "checkpoint":
            return self._from_checkpoint(ckpt, modules, dtype, device, bias)
        if modules == [LM_HEAD]:
            return dense_linear(ckpt, modules, dtype, device, bias)
        return self._on_load(ckpt, modules, dtype, device, bias)

    def _prefixed(self, ckpt) -> bool:
        if self._has_prefix is None:
            self._has_prefix = any(n.startswith("model.") for n in ckpt.names())
        return self._has_prefix

    def _bias(self, ckpt, modules, dtype, device, bias):
        return ckpt.fused([f"{m}.bias" for m in modules], dtype, device) if bias else None

    def _on_load(self, ckpt, modules, dtype, device, bias):
        from services.engine.quantization import weights
        from services.engine.quantization.linear import Fp8Linear, QuantizedLinear

        name = self.plan.name
        if name == "fp8":
            parts = [weights.quantize_fp8(ckpt.get(f"{m}.weight"), m) for m in modules]
            return Fp8Linear(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                             self._bias(ckpt, modules, dtype, device, bias), dtype, device)
        args = weights.scheme_args(name)
        # Each tensor as stored (bf16 stays bf16: the scales are what llm-compressor would compute).
        parts = [weights.quantize(ckpt.get(f"{m}.weight"), args, m) for m in modules]
        return QuantizedLinear(weights.concat(parts), self._bias(ckpt, modules, dtype, device, bias), dtype, device)

    def _from_checkpoint(self, ckpt, modules, dtype, device, bias):
        from services.engine.model import dense_linear
        from services.engine.quantization import weights
        from services.engine.quantization.linear import QuantizedLinear

        ct = self.plan.checkpoint
        if not self._checked:
            ct.check_modules(ckpt.names())
            self._checked = True
        # Names as the checkpoint spells them (with or without `model.`): what the config's
        # targets and ignore list match.
        names = [m if self._prefixed(ckpt) else m.removeprefix("model.") for m in modules]
        schemes = [ct.scheme_of(n) for n in names]
        if all(s is None for s in schemes):
            return dense_linear(ckpt, modules, dtype, device, bias)
        if any(s is None for s in schemes):
            raise ValueError(f"{ct.path}: {', '.join(modules)} are read as one fused projection, but only some of "
                             f"them are quantized")
        parts = [ct.load(ckpt, n, s) for n, s in zip(names, schemes)]
        return QuantizedLinear(weights.concat(parts), self._bias(ckpt, modules, dtype, device, bias), dtype, device)
