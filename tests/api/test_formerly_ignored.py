"""The parameters a client could send before issue 18 that were accepted with a 200 and then had
no effect (or were refused): each now changes the response as it says, or is a 400 naming it.
One request per field on the tiny model (random weights: without the field the output is noise,
so an effect cannot be luck)."""

import json
import re

import openai
import pytest

from tests.api.conftest import MODEL

PROMPT = "The queue holds"
WORD = 300  # a token id of the tiny model's ~4k vocabulary: forced or watched below


def test_response_format_json_schema_is_followed(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}], max_tokens=40,
                                         seed=1, response_format={"type": "json_schema", "json_schema": {
                                             "name": "ok", "schema": schema, "strict": True}})
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)


def test_an_unknown_response_format_type_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "bogus"})
    assert info.value.body["param"].startswith("response_format"), info.value.body


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["left", "right"]}, lambda text: text in ("left", "right")),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
])
def test_vllm_guided_fields_constrain_the_output(client, extra, check):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, seed=2,
                                     extra_body=extra).choices[0].text
    assert check(text), text


def test_a_named_tool_choice_gives_a_tool_call(client):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "find 7"}], max_tokens=40,
                                         seed=3, tools=[tool],
                                         tool_choice={"type": "function", "function": {"name": "lookup"}})
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup" and isinstance(json.loads(call.function.arguments)["id"], int)


def test_logit_bias_and_min_tokens_change_when_it_stops(client):
    # The forced token is also a stop token: without min_tokens the completion ends at once.
    body = {"stop_token_ids": [WORD]}
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logit_bias={str(WORD): 100},
                                      extra_body=body)
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logit_bias={str(WORD): 100},
                                     extra_body={**body, "min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"


def test_best_of_generates_more_than_it_returns(client):
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, seed=4, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    best = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, seed=4, temperature=1.0, best_of=3,
                                     extra_body={"ignore_eos": True})
    assert len(best.choices) == 1
    assert best.usage.completion_tokens == 3 * one.usage.completion_tokens  # every generated token counts
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, best_of=3, stream=True)
    assert info.value.body["param"] == "best_of"


def test_prompt_logprobs_score_every_prompt_token(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == out.usage.prompt_tokens and scored[0] is None  # the first token has no context
    assert all(isinstance(next(iter(entry.values()))["logprob"], float) for entry in scored[1:])


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 4


def test_n_echo_and_prompt_batches_are_no_longer_refused(client):
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Another"], max_tokens=2, n=2, echo=True, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(p) for c, p in zip(out.choices, [PROMPT, PROMPT, "Another", "Another"])] == [True] * 4
