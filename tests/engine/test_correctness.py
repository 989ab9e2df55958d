"""The engine's greedy output is token-identical to transformers, and leaks no blocks."""

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.conftest import assert_no_leak, mixed_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    import json
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    return mixed_prompts(vocab)


@pytest.fixture(scope="module")
def reference(hf, prompts):
    return [hf.greedy(p, MAX_TOKENS) for p in prompts]


def run(model_dir, prompts, **engine_args):
    llm = LLM(model_dir, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Two waves: the second finds the first wave's blocks in the prefix cache.
    first = llm.generate(prompts[::2], params)
    second = llm.generate(prompts[1::2], params)
    outputs = [None] * len(prompts)
    outputs[::2], outputs[1::2] = first, second
    return llm, outputs


def test_greedy_matches_transformers_with_prefix_cache(tiny_model_dir, prompts, reference):
    assert len(prompts) >= 16 and min(map(len, prompts)) == 1 and max(map(len, prompts)) > 400
    llm, outputs = run(tiny_model_dir, prompts, max_num_seqs=16)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) diverged"
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 160  # the shared system prompt was served from the cache
    assert sum(o.num_cached_tokens for o in outputs) == stats["prefix_cache_hits"]
    assert_no_leak(llm.engine)


def test_greedy_matches_transformers_under_preemption_and_chunked_prefill(tiny_model_dir, prompts, reference):
    # 48 blocks of 16 tokens cannot hold the batch: sequences get preempted and recomputed, and
    # a 64-token step budget splits every long prompt into chunks.
    llm, outputs = run(tiny_model_dir, prompts, num_kv_blocks=48, max_num_batched_tokens=64, max_num_seqs=8)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
    assert_no_leak(llm.engine)


def test_greedy_matches_without_prefix_caching(tiny_model_dir, prompts, reference):
    llm, outputs = run(tiny_model_dir, prompts[:8], enable_prefix_caching=False, block_size=8)
    for out, ref in zip(outputs, reference[:8]):
        assert out.outputs[0].token_ids == ref
    assert llm.stats()["prefix_cache_hits"] == 0
    assert_no_leak(llm.engine)
