"""Several choices with the official openai client: n (forked in the engine after prefill),
best_of, batches of completion prompts (one engine request each), streamed with indexes."""

import openai
import pytest

from tests.api.conftest import MODEL

PROMPTS = ["The quick brown fox", "Once upon a time", [5, 17, 42, 99, 7], [300, 301, 302]]


def greedy(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, **kw)


def test_n_gives_n_seeded_choices_reproducibly(client):
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=12, temperature=1.0, seed=1234, n=3,
              extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]  # seeded: the same choices
    assert len(set(texts)) == 3, texts  # each choice its own seed stream
    assert all(c.finish_reason == "length" for c in first.choices)
    prompt_tokens = greedy(client, "Hello there").usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt_tokens  # the prompt is counted once
    assert first.usage.completion_tokens == 3 * 12
    # Choice 0 is the request with n=1 and the same seed: forking changes nothing for it.
    single = client.completions.create(**{**kw, "n": 1})
    assert single.choices[0].text == texts[0]


def test_chat_n(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                           max_tokens=6, seed=7, temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in reply.choices)
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert reply.usage.completion_tokens == 12


def test_streaming_n_has_indexes_and_one_finish_per_choice(client):
    kw = dict(model=MODEL, prompt="Streams of", max_tokens=10, temperature=1.0, seed=99, n=3,
              extra_body={"ignore_eos": True})
    texts, finishes = {0: "", 1: "", 2: ""}, {}
    usage = None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                assert c.index not in finishes  # exactly one final chunk per choice
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    whole = client.completions.create(**kw)
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]  # streamed == collected
    assert usage.completion_tokens == 30 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_batch_of_prompts_in_order(client):
    batch = greedy(client, PROMPTS)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [greedy(client, p) for p in PROMPTS]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_batch_streamed_with_indexes(client):
    texts = {}
    for chunk in greedy(client, PROMPTS, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    batch = greedy(client, PROMPTS)
    assert [texts[i] for i in range(4)] == [c.text for c in batch.choices]


def test_batch_times_n(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=1.0, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(PROMPTS[:2]):  # choices p*n .. p*n+n-1 are prompt p's
        alone = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=5, temperature=1.0, seed=5)
        assert [c.text for c in out.choices[2 * p:2 * p + 2]] == [c.text for c in alone.choices]


def test_best_of_returns_the_most_likely(client):
    kw = dict(model=MODEL, prompt="Pick the best", max_tokens=6, temperature=1.0, seed=3)
    many = client.completions.create(**kw, n=4, logprobs=0)
    ranked = sorted(many.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**kw, best_of=4)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == ranked[0].text
    assert best.choices[0].logprobs is None  # ranked with logprobs, which were not asked for
    two = client.completions.create(**kw, n=2, best_of=4, logprobs=1)
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]]
    assert two.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 17}, "n"),
    ({"best_of": 17}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 0}, "n"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": ["ok", [1, -2]]}, "prompt"),
])
def test_bad_choices_are_400_naming_the_field(client, kwargs, param):
    kw = {"model": MODEL, "prompt": "x", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kw)
    assert err.value.body["param"] == param, err.value.body
    assert greedy(client, "still serving").choices[0].text is not None  # the stack serves on


def test_chat_streaming_n(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], n=2, max_tokens=5, seed=11,
              temperature=1.0, extra_body={"ignore_eos": True})
    roles, texts, finishes = {}, {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and finishes == {0: "length", 1: "length"}
    whole = client.chat.completions.create(**kw)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
