"""Structured outputs over HTTP with the official openai client, against a real stack (tiny
model: random weights, so valid output shows the constraint at work): response_format
json_schema / json_object, vLLM's structured_outputs and the legacy guided_* fields, streaming
and not; a bad constraint is a 400 naming the field and the stack keeps serving."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL
from tests.engine.test_structured import MAX_TOKENS, SCHEMAS, json_prefix_ok


def chat(client, max_tokens=MAX_TOKENS, seed=0, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
                                          max_tokens=max_tokens, temperature=1.0, seed=seed, **kwargs)


async def test_ten_json_schemas_over_response_format(aclient):
    async def one(i, schema):
        return await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Item {i} as JSON."}], max_tokens=MAX_TOKENS,
            temperature=1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})

    responses = await asyncio.gather(*(one(i, s) for i, s in enumerate(SCHEMAS)))
    for response, schema in zip(responses, SCHEMAS):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_structured_outputs_and_guided_fields_on_completions(client):
    schema = SCHEMAS[0]
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                  {"guided_json": json.dumps(schema)}):
        out = client.completions.create(model=MODEL, prompt="Person:", max_tokens=MAX_TOKENS, temperature=1.0,
                                        seed=3, extra_body=extra).choices[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    regex = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        out = client.completions.create(model=MODEL, prompt="Street:", max_tokens=32, temperature=1.0, seed=1,
                                        extra_body=extra).choices[0]
        assert re.fullmatch(regex, out.text), out.text
    choices = ["alpha", "beta", "gamma delta"]
    for seed, extra in enumerate(({"structured_outputs": {"choice": choices}}, {"guided_choice": choices})):
        out = chat(client, max_tokens=16, seed=seed, extra_body=extra).choices[0]
        assert out.message.content in choices
    grammar = 'root ::= "on" | "off"'
    for extra in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        assert chat(client, max_tokens=8, extra_body=extra).choices[0].message.content in ("on", "off")


def test_json_object(client):
    for seed in range(3):
        out = chat(client, max_tokens=48, seed=seed, response_format={"type": "json_object"}).choices[0]
        text = out.message.content
        if out.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # random weights rarely close a free-form string: a cut-off object must still be a prefix of one
            assert text.lstrip().startswith("{") and json_prefix_ok(text), text
    text = chat(client, max_tokens=48, response_format={"type": "text"}).choices[0].message.content
    assert not json_prefix_ok(text)  # unconstrained: noise


def test_a_streamed_structured_reply_validates(client):
    schema = SCHEMAS[9]
    stream = chat(client, seed=5, stream=True,
                  response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": schema}})
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop" and len(parts) > 3
    jsonschema.validate(json.loads("".join(parts)), schema)


@pytest.mark.parametrize("extra,field,reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "structured_outputs.json", "Type should be a string"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "parenthesis"),
    ({"guided_grammar": "root ::= nowhere"}, "structured_outputs.grammar", "nowhere"),
    ({"response_format": {"type": "bogus"}}, "response_format.type", "bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a+"}, "guided_decoding_backend", "xgrammar"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(client, extra, field, reason):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=8, extra_body=extra)
    assert info.value.status_code == 400
    error = info.value.body
    assert field in (error.get("param") or "") + error["message"] and reason in error["message"], error
    # The stack keeps serving, constrained requests included.
    assert chat(client, max_tokens=8, extra_body={"guided_choice": ["x", "y"]}).choices[0].message.content in ("x", "y")
