"""Helpers for engine tests: the transformers reference and the no-leak check."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class HFReference:
    """Greedy decoding with transformers, fp32, one prompt at a time (no padding effects)."""

    def __init__(self, model_dir):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        self.model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
        ids = torch.tensor([prompt_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=0, **kwargs)
        return out[0, len(prompt_ids):].tolist()

    @torch.inference_mode()
    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="session")
def hf(tiny_model_dir):
    return HFReference(tiny_model_dir)


def assert_no_leak(engine) -> None:
    """Every block is free and unreferenced once nothing runs."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.requests


def mixed_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """16+ token-id prompts of 1 to several hundred tokens; several share long prefixes."""
    rng = random.Random(seed)

    def rand(n):
        return [rng.randrange(8, vocab_size) for _ in range(n)]

    system = rand(160)  # a shared "system prompt"
    history = system + rand(90)  # a shared conversation history on top of it
    prompts = [[1], rand(2), rand(7), rand(16), rand(17), rand(33), rand(64), rand(129), rand(300), rand(410)]
    prompts += [system + rand(n) for n in (1, 5, 23)]
    prompts += [history + rand(n) for n in (3, 40)]
    prompts += [system]  # exactly the shared prefix (a multiple of the block size)
    prompts += [rand(250) for _ in range(2)]
    return prompts
