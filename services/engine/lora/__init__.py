"""LoRA adapters served beside one base model: PEFT loading (adapter), device slots and the host
cache (manager), the fused layers with deltas beside them (layers; kernels in kernels.lora)."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.lora.adapter import LoRAAdapterError, inspect_adapter, load_adapter


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to use for a request, as vLLM's offline API names it: registered on first use."""

    lora_name: str
    lora_path: str


__all__ = ["LoRAAdapterError", "LoRARequest", "inspect_adapter", "load_adapter"]
