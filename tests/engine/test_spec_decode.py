"""Speculative decoding in the engine, on the tiny shape rebuilt to copy its prompt
(shared.copying_model), so drafts are accepted and rejected for real:

- greedy output is token-identical with and without speculation (n-gram and draft model), with
  the prefix cache, under preemption and chunked prefill, and on the Triton backend;
- a draft model equal to the target accepts every draft under greedy;
- seeded requests give the same output alone, in a crowd, and without speculation;
- stop tokens, stop strings and max_tokens inside a speculated run end it there;
- only accepted tokens enter the prefix-cache hash chain (the KV events equal the plain run's);
- no block leaks; a resumed stream continues as the uninterrupted one.
"""

import json
import os

import pytest

from services.engine import LLM, SamplingParams
from services.engine.config import EngineArgs
from services.engine.llm_engine import LLMEngine, load_tokenizer
from shared.copying_model import make_copying_model
from tests.engine.conftest import assert_no_leak, mixed_prompts

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def copying(tiny_model_dir, tmp_path_factory):
    """(target, draft): the tiny shape copying its prompt; the draft another build (another seed)."""
    root = tmp_path_factory.mktemp("copying")
    return make_copying_model(tiny_model_dir, root / "target", seed=0), make_copying_model(tiny_model_dir,
                                                                                          root / "draft", seed=1)


def ngram(k=4, **extra):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4, **extra}


def draft(model, k=3, **extra):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def prompts(copying):
    """The held prompts (random ids, shared prefixes, 1 to 410 tokens) and texts to copy."""
    target, _ = copying
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    llm_tok = load_tokenizer(target)
    text = open("shared/data/corpus.txt", encoding="utf-8").read()
    copies = []
    for start, length in ((0, 300), (2000, 500), (5000, 120)):
        ids = llm_tok.encode(text[start:start + length], add_special_tokens=False)
        copies.append(ids + llm_tok.encode("\n\n", add_special_tokens=False) + ids[:6])
    return mixed_prompts(vocab)[::2] + copies


def generate(model, prompts, params, **engine_args):
    llm = LLM(model, **engine_args)
    # Two waves: the second finds the first wave's blocks in the prefix cache.
    first = llm.generate(prompts[::2], params)
    second = llm.generate(prompts[1::2], params)
    outputs = [None] * len(prompts)
    outputs[::2], outputs[1::2] = first, second
    return llm, [o.outputs[0].token_ids for o in outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(copying, prompts):
    return generate(copying[0], prompts, GREEDY, max_num_seqs=8)[1]


def spec_args(name, copying):
    return ngram(adaptive=False) if name == "ngram" else draft(copying[1], adaptive=False)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("setting", [
    dict(max_num_seqs=8),
    # 48 blocks of 16 tokens cannot hold the batch: preemption and recomputation; a 64-token
    # step budget splits every long prompt into chunks (and limits the drafts of a step).
    dict(num_kv_blocks=48, max_num_batched_tokens=64, max_num_seqs=6),
], ids=["prefix-cache", "preemption-chunked-prefill"])
def test_greedy_output_is_identical_with_speculation(copying, prompts, reference, method, setting):
    llm, outputs = generate(copying[0], prompts, GREEDY, speculative_config=spec_args(method, copying), **setting)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out == ref, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0.3 * stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # rejections too
    if "num_kv_blocks" in setting:
        assert stats["num_preemptions"] > 0
    else:
        assert stats["prefix_cache_hits"] > 0
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position j is reached only past j - 1
    assert_no_leak(llm.engine)


def test_a_draft_model_equal_to_the_target_accepts_every_draft(copying, prompts, reference):
    target = copying[0]
    llm, outputs = generate(target, prompts, GREEDY, max_num_seqs=8, speculative_config=draft(target, k=4,
                                                                                              adaptive=False))
    assert outputs == reference
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 100
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_requests_ignore_the_batch_and_the_speculation(copying, prompts, method):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, seed=1234,
                            max_tokens=MAX_TOKENS, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = prompts[-2]
    plain = LLM(copying[0]).generate([prompt], seeded)[0].outputs[0].token_ids
    llm = LLM(copying[0], speculative_config=spec_args(method, copying))
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    crowd = llm.generate([prompts[-1], prompt, prompts[-3]], [other, seeded, other])[1].outputs[0].token_ids
    assert alone == crowd == plain
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leak(llm.engine)


def test_unseeded_sampling_with_a_draft_model_runs_and_frees_everything(copying, prompts):
    """Rejection sampling against the draft's distributions (its exactness: test_spec_decode_sampling)."""
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    llm = LLM(copying[0], speculative_config=draft(copying[1], adaptive=False))
    outs = llm.generate(prompts[-3:], params)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == MAX_TOKENS and len(completion.logprobs) == MAX_TOKENS
        assert all(t in lp for t, lp in zip(completion.token_ids, completion.logprobs))
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_run_ends_at_a_stop_token_stop_string_or_max_tokens_inside_it(copying, prompts, method):
    prompt = prompts[-3]
    target = copying[0]
    full = LLM(target).generate([prompt], GREEDY)[0].outputs[0]
    llm = LLM(target, speculative_config=spec_args(method, copying))
    tok = llm.tokenizer
    cases = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # 7 = 1 + 4 + 2: inside a run of drafts
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[full.token_ids[9]]),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                       stop=[tok.decode(full.token_ids[11:13])]),
    ]
    plain = LLM(target)
    for params in cases:
        expected = plain.generate([prompt], params)[0].outputs[0]
        got = llm.generate([prompt], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text,
                                                                expected.finish_reason)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leak(llm.engine)


def stored_hashes(engine: LLMEngine, prompts, params) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    stored = []
    while engine.has_unfinished_requests():
        engine.step()
        stored += engine.drain_kv_events().stored
    return stored


def test_only_accepted_tokens_enter_the_hash_chain_and_kv_events(copying, prompts):
    """The copies make long accepted runs and rejections: the blocks stored in the prefix cache
    (and announced as KV events) are exactly the plain run's, so no rejected token is hashed."""
    target = copying[0]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = stored_hashes(LLMEngine(target, EngineArgs(num_kv_blocks=256)), prompts[-3:], params)
    for config in (ngram(adaptive=False), draft(copying[1], adaptive=False)):
        engine = LLMEngine(target, EngineArgs(num_kv_blocks=256, speculative_config=config))
        speculated = stored_hashes(engine, prompts[-3:], params)
        assert sorted(speculated) == sorted(plain)
        assert engine.spec.stats.num_accepted_tokens > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_resumed_stream_continues_the_uninterrupted_one(copying, prompts, method):
    target = copying[0]
    prompt = prompts[-2]
    params = dict(max_tokens=40, ignore_eos=True, temperature=0.0)
    config = spec_args(method, copying)
    engine = LLMEngine(target, EngineArgs(num_kv_blocks=256, speculative_config=config))
    whole = LLM(target).generate([prompt], SamplingParams(**params))[0].outputs[0]
    # The first leg: a few steps (several tokens each), then lost.
    engine.add_processed("first", None, prompt, SamplingParams(**params))
    sent, text = [], ""
    for _ in range(4):
        for out in engine.step():
            sent += out.new_token_ids
            text += out.text_delta
    engine.abort_request("first")
    engine.step()
    assert 4 < len(sent) < 40  # speculation delivered more than a token per step
    # The original max_tokens: the engine counts the resumed tokens against it.
    engine.add_processed("second", None, prompt + sent, SamplingParams(**params), resumed=(len(sent), len(text)))
    rest, rest_text = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest += out.new_token_ids
            rest_text += out.text_delta
    assert sent + rest == whole.token_ids and text + rest_text == whole.text
    assert_no_leak(engine)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("STRATA_KERNEL_DEVICE") != "cuda",
                    reason="needs CUDA or the Triton interpreter")
def test_verification_through_the_triton_prefill_kernel(copying, prompts):
    device = "cuda" if os.environ.get("STRATA_KERNEL_DEVICE") == "cuda" else "cpu"
    target = copying[0]
    batch = [prompts[-1][:60], prompts[-3][:40]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kwargs = dict(attention_backend="triton", device=device, dtype="float32", num_kv_blocks=32)
    plain = LLM(target, **kwargs).generate(batch, params)
    llm = LLM(target, speculative_config=ngram(k=3, adaptive=False), **kwargs)
    assert llm.engine.runner.ops.name == "triton"
    speculated = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in speculated] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leak(llm.engine)


def test_requests_report_their_acceptance(copying, prompts):
    llm = LLM(copying[0], speculative_config=ngram(adaptive=False))
    out = llm.generate([prompts[-2]], GREEDY)[0]
    m = out.metrics
    assert m.num_draft_tokens > 0 and 0 < m.num_accepted_tokens <= m.num_draft_tokens
    assert m.acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
    stats = llm.stats()
    assert (m.num_draft_tokens, m.num_accepted_tokens) == (stats["spec_decode_num_draft_tokens"],
                                                           stats["spec_decode_num_accepted_tokens"])


def test_speculation_over_int8_weights_and_kv_cache_changes_no_token(copying, prompts):
    """Verification reads a quantized KV cache and runs quantized projections exactly as plain
    decoding does, so speculation still changes no greedy token."""
    precision = dict(quantization="int8", kv_cache_dtype="int8", max_num_seqs=8)
    plain = generate(copying[0], prompts, GREEDY, **precision)[1]
    llm, outputs = generate(copying[0], prompts, GREEDY, speculative_config=ngram(adaptive=False), **precision)
    assert outputs == plain
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leak(llm.engine)
