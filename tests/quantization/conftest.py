"""A small Qwen2-shaped model for the quantization tests: bf16 checkpoint (as real models ship),
q/k/v biases, tied embeddings, GQA, and widths that are multiples of int4's group of 128."""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import AttentionMetadata
from shared.realistic_models import SHAPES, ensure_model, scaled

SHAPE = scaled(SHAPES["L"], hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=2048,
               vocab_size=1500, max_position=2048)
CORPUS_BYTES = 1_500_000  # enough text for a 1,500-token BPE


@pytest.fixture(scope="session")
def quant_model_dir(tmp_path_factory):
    home = tmp_path_factory.mktemp("quant-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_HOME", str(home))  # its tokenizer cache lands here, not in ~/.strata
        return ensure_model(SHAPE, home / "models" / "qwen2-small", max_corpus_bytes=CORPUS_BYTES)


def _prefill_meta(start: int, n: int, table: torch.Tensor) -> AttentionMetadata:
    """One sequence's prefill chunk [start, start + n) over blocks 0, 1, ... of the cache."""
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.arange(start, start + n, dtype=torch.int64), num_decodes=0,
                             decode_block_tables=empty.view(0, 0), decode_context_lens=empty,
                             num_prefill_tokens=n, prefill_block_tables=table,
                             prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             prefill_context_lens=torch.tensor([start + n], dtype=torch.int32),
                             prefill_query_lens_host=[n], prefill_context_lens_host=[start + n])


@torch.inference_mode()
def prompt_logits(llm, ids: list[int], first_chunk: int | None = None) -> torch.Tensor:
    """The model's logits at every position of one prompt (teacher-forced), fp32 [len(ids), vocab],
    through the engine's model and KV cache; the engine must be idle. With `first_chunk`, two
    prefill chunks: the second attends to the first through the cache (as chunked prefill and
    prefix-cache hits do)."""
    runner = llm.engine.runner
    n = len(ids)
    blocks = -(-n // runner.block_size)
    assert blocks <= runner.num_blocks
    table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    bounds = [0, n] if first_chunk is None else [0, first_chunk, n]
    out = []
    for start, end in zip(bounds, bounds[1:]):
        hidden = runner.model.forward(torch.tensor(ids[start:end]), torch.arange(start, end),
                                      _prefill_meta(start, end - start, table), runner.kv_caches)
        out.append(runner.model.logits(hidden).float())
    return torch.cat(out)
