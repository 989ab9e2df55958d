"""Adapters for the LoRA tests, built with PEFT itself on the tiny model."""

from __future__ import annotations

import pytest
import torch

# Each adapter differs in rank, targets and scaling, so a mix-up between them shows.
ADAPTERS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r16": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]),
    "qv-rs": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj"]),
}


def build_peft_adapter(model_dir, out_dir, seed: int, **lora_args):
    """A PEFT LoRA adapter with random (non-zero) A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_args))
    with torch.no_grad():  # B at PEFT's non-default init is large for this tiny model: keep outputs sane
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def peft_adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_peft_adapter(tiny_model_dir, root / name, seed=i, **args)
            for i, (name, args) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="session")
def hf(tiny_model_dir):
    from tests.engine.conftest import HFReference

    return HFReference(tiny_model_dir)
