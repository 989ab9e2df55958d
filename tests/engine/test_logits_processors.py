"""Logits processors in the engine (services/engine/logits_processors.py), with the offline LLM
on the tiny model: logit_bias, allowed_token_ids, bad_words, min_tokens; their ranges refused
at add time; and speculative decoding staying exact with them."""

import pytest

from services.engine import LLM, InvalidRequestError, SamplingParams
from services.engine.logits_processors import bad_words_token_ids
from shared.copying_model import make_copying_model
from tests.engine.conftest import assert_no_leak

PROMPTS = ["The queue holds", "In the beginning there was a function that", "import asyncio\n\nasync def"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_num_seqs=8, num_kv_blocks=256)


def ids_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(llm):
    plain = ids_of(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    forced = 1234
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True,
                                               logit_bias={forced: 100}))
    assert all(ids == [forced] * 12 for ids in ids_of(out))
    # Ban the greedy choice of each prompt's first step: the first token changes, and it never appears.
    for prompt, ids in zip(PROMPTS, plain):
        banned = ids[0]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    logit_bias={banned: -100}))[0].outputs[0].token_ids
        assert banned not in out
    # A row with a bias does not change its neighbours in the batch.
    mixed = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  logit_bias={forced: 100}),
                                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])
    assert ids_of(mixed)[1:] == plain[1:]
    assert_no_leak(llm.engine)


def test_allowed_token_ids_are_the_only_tokens_sampled(llm):
    allowed = [100, 200, 300, 400]
    for params in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, seed=7, max_tokens=32, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, top_k=3, seed=1, max_tokens=32, ignore_eos=True,
                                  allowed_token_ids=allowed, repetition_penalty=1.3)):
        for ids in ids_of(llm.generate(PROMPTS, params)):
            assert set(ids) <= set(allowed), ids
    sampled = ids_of(llm.generate(PROMPTS, SamplingParams(temperature=1.5, seed=7, max_tokens=64, ignore_eos=True,
                                                          allowed_token_ids=allowed)))
    assert len({t for ids in sampled for t in ids}) > 1  # sampling among them, not one forced token


def test_bad_words_are_never_generated(llm):
    tokenizer = llm.tokenizer
    plain = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    # Ban a two-token stretch of the greedy output (as a word: its text) and a single token.
    two = tokenizer.decode(plain.token_ids[4:6]).strip()
    one = tokenizer.decode(plain.token_ids[1:2]).strip()
    words = [w for w in (two, one) if w]
    banned = bad_words_token_ids(words, tokenizer)
    assert banned and all(isinstance(t, int) for w in banned for t in w)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    bad_words=words))[0].outputs[0]
    assert out.token_ids != plain.token_ids
    for word in banned:
        n = len(word)
        assert all(out.token_ids[i:i + n] != word for i in range(len(out.token_ids) - n + 1)), (word, out.token_ids)
    assert_no_leak(llm.engine)


def test_bad_words_tokenized_with_and_without_a_leading_space(llm):
    tokenizer = llm.tokenizer
    ids = bad_words_token_ids(["queue"], tokenizer)
    bare = tokenizer.encode("queue", add_special_tokens=False)
    spaced = tokenizer.encode(" queue", add_special_tokens=False)
    assert ids[0] == bare
    assert (spaced in ids) == (spaced[0] != bare[0] and len(spaced) == len(bare))


def test_min_tokens_masks_eos_and_stop_ids_until_reached(llm):
    eos = sorted(llm.engine.eos_token_ids)
    # Make EOS the certain choice: without min_tokens the request ends at once.
    push_eos = {t: 100 for t in eos}
    first = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, logit_bias=push_eos))[0].outputs[0]
    assert first.finish_reason == "stop" and len(first.token_ids) == 1
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, logit_bias=push_eos,
                                                    min_tokens=7))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 8 and out.token_ids[-1] in eos
    assert not set(out.token_ids[:7]) & set(eos)
    # stop_token_ids too, sampled rows too.
    stop_id = 555
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True,
                                                    stop_token_ids=[stop_id], logit_bias={stop_id: 100},
                                                    min_tokens=5))[0].outputs[0]
    assert out.token_ids == [t for t in out.token_ids[:5] if t != stop_id] + [stop_id]
    assert len(out.token_ids) == 6 and out.finish_reason == "stop"
    assert_no_leak(llm.engine)


def test_min_tokens_defers_stop_strings(llm):
    plain = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = plain.text[2:5]
    assert len(stop) == 3
    early = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                      stop=[stop]))[0].outputs[0]
    late = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                     min_tokens=len(early.token_ids) + 5))[0].outputs[0]
    assert len(late.token_ids) >= len(early.token_ids) + 5
    assert late.token_ids[:len(early.token_ids)] == early.token_ids


@pytest.mark.parametrize("params, param", [
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={10**9: 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10**9]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
])
def test_out_of_range_values_are_refused_naming_the_field(llm, params, param):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPTS[0]], SamplingParams(**params))
    assert info.value.param == param
    assert_no_leak(llm.engine)


@pytest.mark.slow
def test_speculative_decoding_stays_exact_with_processors(tiny_model_dir, tmp_path_factory):
    """The copying model makes n-gram drafts right most of the time; a bias or bad word that
    changes the copy must reject them, so the speculated output equals the plain one."""
    model = make_copying_model(tiny_model_dir, tmp_path_factory.mktemp("copying") / "target", seed=0)
    plain = LLM(model, num_kv_blocks=256)
    text = open("shared/data/corpus.txt", encoding="utf-8").read()[:400]
    ids = plain.tokenizer.encode(text, add_special_tokens=False)
    prompt = ids + plain.tokenizer.encode("\n\n", add_special_tokens=False) + ids[:6]
    copied = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    copied = copied.outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias={copied[5]: -100}),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                             bad_words=[plain.tokenizer.decode(copied[8:10])]),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, allowed_token_ids=sorted(set(copied[:12])))]
    expected = ids_of(plain.generate([prompt] * 3, params))
    assert all(e != copied for e in expected)  # each one changes the copy
    spec = LLM(model, num_kv_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                                              "adaptive": False})
    got = spec.generate([prompt] * 3, params)
    assert ids_of(got) == expected
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0  # it did speculate
    assert_no_leak(spec.engine)
