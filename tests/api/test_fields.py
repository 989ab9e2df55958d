"""Issue 18's fields over HTTP with the official openai client on the tiny model: logit_bias,
min_tokens, allowed_token_ids, bad_words and their 400s; continuous usage stats; top_logprobs up
to 20; /tokenize and /detokenize (vLLM's shapes); models.retrieve; /version; unknown fields
refused (and counted), OpenAI's `user`, `store`, `metadata`, `service_tier` and `modalities`; and
the end-of-stream flush of an incomplete UTF-8 character."""

import json
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import MODEL

PROMPT = "The queue holds"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Größe und Straße?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(stack.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {stack.api_key}"})
    return _open(request)


def get(stack, path: str, key: bool = True) -> tuple[int, dict | str]:
    headers = {"Authorization": f"Bearer {stack.api_key}"} if key else {}
    return _open(urllib.request.Request(stack.base_url + path, headers=headers))


def _open(request) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def word_token(tokenizer) -> int:
    """A token that decodes to a plain word on its own."""
    return next(t for t in range(200, tokenizer.vocab_size) if tokenizer.decode([t]).strip().isalpha())


def test_logit_bias_forces_a_token(client, tokenizer):
    forced = word_token(tokenizer)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=1,
                                    logit_bias={str(forced): 100})
    assert out.usage.completion_tokens == 6
    assert out.choices[0].text == tokenizer.decode([forced] * 6)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 4)


def test_allowed_token_ids_and_bad_words(client, tokenizer):
    allowed = [word_token(tokenizer), word_token(tokenizer) + 1]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=2,
                                    logprobs=0, extra_body={"allowed_token_ids": allowed})
    assert set(out.choices[0].logprobs.tokens) <= {tokenizer.decode([a]) for a in allowed}
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0)
    word = plain.choices[0].logprobs.tokens[0]  # the first token's text: a one-token bad word
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                                       extra_body={"bad_words": [word]})
    assert banned.choices[0].text != plain.choices[0].text
    assert word not in banned.choices[0].logprobs.tokens


def test_min_tokens_is_honoured(client, tokenizer):
    eos = {str(tokenizer.eos_token_id): 100}  # EOS the certain choice
    early = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, logit_bias=eos)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    late = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, logit_bias=eos,
                                     extra_body={"min_tokens": 5})
    assert late.choices[0].finish_reason == "stop" and late.usage.completion_tokens == 6


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"not-an-id": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"stream_options": {"continuous_usage_stats": 1}, "stream": True}, "stream_options"),
])
def test_out_of_range_fields_are_400s_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)  # still serving


def test_min_tokens_above_max_tokens_is_refused_by_the_engine(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": 5})
    assert "min_tokens" in info.value.message


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_on_every_chunk(client, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                stream=True, stream_options=options)
    else:
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                           stream_options=options)
    chunks = list(stream)
    assert chunks and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 10
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_top_logprobs_up_to_20(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=20)
    assert all(len(t.top_logprobs) == 20 for t in chat.choices[0].logprobs.content)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=20)
    # Keyed by token text (OpenAI's shape): tokens that decode alike (lone bytes: U+FFFD) share a key.
    assert all(10 < len(t) <= 20 for t in out.choices[0].logprobs.top_logprobs), out.choices[0].logprobs.top_logprobs
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=21)


def test_skip_special_tokens_and_include_stop_str_in_output(client, tokenizer):
    eos = {str(tokenizer.eos_token_id): 100}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias=eos,
                                    extra_body={"skip_special_tokens": False, "ignore_eos": True})
    assert out.choices[0].text == tokenizer.eos_token * 3
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = plain[3:6]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop


def test_kept_special_tokens_count_in_text_offset(client, tokenizer):
    """skip_special_tokens false: the special tokens are in the text, so text_offset counts them."""
    eos = {str(tokenizer.eos_token_id): 100}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias=eos,
                                    logprobs=0, extra_body={"skip_special_tokens": False, "ignore_eos": True})
    choice = out.choices[0]
    width = len(tokenizer.eos_token)
    assert choice.text == tokenizer.eos_token * 3 and choice.logprobs.text_offset == [0, width, 2 * width]


def test_tokenize_round_trips_with_detokenize(api_stack, client, tokenizer):
    text = "Größe und Straße: the queue holds 42 items."
    status, body = post(api_stack, "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200, body
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] is None and body["max_model_len"] > 0
    status, bare = post(api_stack, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                 "return_token_strs": True})  # model: the only one served
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    status, back = post(api_stack, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]})
    assert status == 200 and back == {"prompt": text}
    # Chat messages: the ids a chat completion is given, and their text the rendered template.
    status, chat = post(api_stack, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert status == 200, chat
    used = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    status, back = post(api_stack, "/detokenize", {"model": MODEL, "tokens": chat["tokens"]})
    assert back == {"prompt": rendered}
    # Bad input: 400s naming the field; an unknown model 404s.
    assert post(api_stack, "/detokenize", {"model": MODEL, "tokens": [10**9]})[1]["error"]["param"] == "tokens"
    assert post(api_stack, "/tokenize", {"model": MODEL})[0] == 400
    status, missing = post(api_stack, "/tokenize", {"model": "no-such-model", "prompt": "x"})
    assert status == 404 and missing["error"]["code"] == "model_not_found"


def test_models_retrieve_and_list_entries(api_stack, client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    entry = model.model_dump()
    assert entry["max_model_len"] > 0 and entry["parent"] is None and entry["root"]
    assert entry["permission"][0]["object"] == "model_permission"
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert set(listed[MODEL]) >= {"root", "parent", "max_model_len", "permission"}
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert get(api_stack, f"/v1/models/{MODEL}", key=False)[0] == 401  # like /v1/models


def test_version(api_stack):
    status, body = get(api_stack, "/version")
    assert status == 200 and isinstance(body["version"], str) and body["version"]
    assert get(api_stack, "/version", key=False)[0] == 401


def test_an_unknown_field_is_refused_naming_it_and_counted(api_stack, client):
    def counted(field: str) -> float:
        _, text = get(api_stack, "/metrics", key=False)
        for line in text.splitlines():
            if line.startswith("strata:gateway_unknown_request_fields_total{") and f'field="{field}"' in line \
                    and 'endpoint="/v1/completions"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = counted("frobnicate")
    for value in (True, 2):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"frobnicate": value})
        assert info.value.status_code == 400 and info.value.body["param"] == "frobnicate"
        assert "Unrecognized request argument supplied: 'frobnicate'" in info.value.body["message"]
        assert info.value.body["code"] == "unrecognized_request_argument"
    assert counted("frobnicate") == before + 2
    # Several: the message names them all (in the body's order), stream_options' own too.
    status, body = post(api_stack, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True, "detail": 1},
        "reasoning_effort": "low"})
    assert status == 400 and body["error"]["param"] == "reasoning_effort"
    assert "'reasoning_effort', 'stream_options.detail'" in body["error"]["message"]
    # The gateway still serves.
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_openai_request_metadata_fields(api_stack, client):
    """`user` is taken (it goes on the request's log line and span); `store`, `metadata`,
    `service_tier` and `modalities` where they ask for what this server does, else a 400 naming
    the field."""
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, user="end-user-7",
                                         store=False, service_tier="auto", modalities=["text"], metadata={})
    assert out.usage.completion_tokens == 2
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, user="u").usage.completion_tokens == 2
    for field, value in (("store", True), ("metadata", {"run": "7"}), ("service_tier", "flex"),
                         ("modalities", ["text", "audio"]), ("user", 7)):
        status, body = post(api_stack, "/v1/chat/completions",
                            {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value})
        assert status == 400 and body["error"]["param"] == field, (field, body)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_text_ending_mid_character_is_flushed_as_the_tokenizer_decodes_it(client, tokenizer, stream, n):
    """A greedy completion whose last token is a lone lead byte of a multi-byte character (the
    word first, then the byte: logit_bias orders the two allowed tokens, and the text prompt
    ends where the word run does): the HTTP text equals tokenizer.decode of the same ids
    (U+FFFD), as the offline engine gives, streaming or not."""
    lead = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "\ufffd")
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=n, temperature=0, logprobs=0,
                  extra_body={"allowed_token_ids": [lead]})
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs)
    else:
        out = client.completions.create(**kwargs)
        text, tokens = out.choices[0].text, out.usage.completion_tokens
    assert tokens == n
    assert text == tokenizer.decode([lead] * n) and text.endswith("\ufffd")
