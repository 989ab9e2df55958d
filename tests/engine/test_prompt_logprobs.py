"""Prompt logprobs (vLLM's prompt_logprobs) equal transformers' fp32 log-softmax of the same
model's logits: whole prompts, chunked prefill, and prompts whose blocks are in the prefix cache."""

import json
import random

import pytest

from services.engine import LLM, SamplingParams, prompt_logprobs
from services.engine.sampling_params import InvalidRequestError
from tests.engine.conftest import assert_no_leak

TOP_N = 5


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    shared = [rng.randrange(8, vocab) for _ in range(48)]  # three full blocks of 16
    return [[rng.randrange(8, vocab) for _ in range(n)] for n in (2, 9, 70)] + [shared, shared + [5, 6, 7]]


def check(outputs, prompts, hf) -> None:
    for out, prompt in zip(outputs, prompts):
        ref = hf.logprobs(prompt)  # row p: the distribution of token p + 1
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) - 1
        for p, e in enumerate(entries):
            row = ref[p]
            assert e.token_id == prompt[p + 1]
            assert abs(e.logprob - row[e.token_id].item()) < 1e-4
            assert e.rank == int((row > row[e.token_id]).sum()) + 1
            top = row.topk(TOP_N)
            assert len(e.top) == TOP_N
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(e.top[t] - v) < 1e-4  # (a near tie may swap two ids: then this fails loudly)


@pytest.mark.parametrize("engine_args, rows_per_slice", [
    ({}, prompt_logprobs.ROWS_PER_SLICE),
    ({"max_num_batched_tokens": 16, "block_size": 16}, prompt_logprobs.ROWS_PER_SLICE),  # 70 tokens in 5 chunks
    ({}, 8),  # the logits of a step's prompt rows a few rows at a time
], ids=["whole", "chunked", "sliced"])
def test_prompt_logprobs_match_transformers(tiny_model_dir, prompts, hf, engine_args, rows_per_slice, monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", rows_per_slice)
    llm = LLM(tiny_model_dir, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_N, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    check(outputs, prompts, hf)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)
    assert_no_leak(llm.engine)


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model_dir, prompts, hf):
    llm = LLM(tiny_model_dir, dtype="float32", enable_prefix_caching=True, block_size=16)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    warm = llm.generate([prompts[3]], plain)  # caches the shared 48-token prefix
    assert warm[0].prompt_logprobs is None
    again = llm.generate([prompts[4]], plain)
    assert again[0].num_cached_tokens == 48  # the cache holds it
    outputs = llm.generate(prompts[3:], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_N))
    assert [o.num_cached_tokens for o in outputs] == [0, 0]  # computed, not served from the cache
    check(outputs, prompts[3:], hf)
    assert_no_leak(llm.engine)


def test_max_tokens_zero_is_prefill_only(tiny_model_dir, prompts, hf):
    llm = LLM(tiny_model_dir, dtype="float32")
    out, = llm.generate([prompts[2]], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert all(e.top == {} for e in out.prompt_logprobs)
    ref = hf.logprobs(prompts[2])
    assert max(abs(e.logprob - ref[p][e.token_id].item()) for p, e in enumerate(out.prompt_logprobs)) < 1e-4
    assert_no_leak(llm.engine)
    with pytest.raises(InvalidRequestError) as err:  # without prompt logprobs, 0 tokens is nothing to do
        llm.generate([prompts[2]], SamplingParams(max_tokens=0))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([prompts[2]], SamplingParams(prompt_logprobs=21))
    assert err.value.param == "prompt_logprobs"
