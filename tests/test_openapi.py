"""/openapi.json says exactly what the gateway accepts: every body its schemas allow parses.

(Bodies the schemas refuse are fuzzed against the running gateway in tests/fault/test_bad_input.)
What no static schema can say is checked at run time: a prompt plus max_tokens past the model's
context, token ids past its vocabulary, a model that is not served.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis_jsonschema import from_schema

from services.gateway import openai_api as oa
from services.gateway.openapi import openapi_spec


def schema(name: str) -> dict:
    spec = openapi_spec()
    out = json.loads(json.dumps(spec["components"]["schemas"][name]))
    out["components"] = spec["components"]
    return out


@pytest.mark.parametrize("name, parse", [("CompletionRequest", oa.parse_completion),
                                         ("ChatCompletionRequest", oa.parse_chat)])
def test_every_body_the_schema_allows_is_accepted(name, parse):
    # Generating chat bodies from the schema costs about 0.9 s each on 2 cores: 40 of each keep the suite inside its hour.
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(from_schema(schema(name)))
    def check(body):
        parse(body)  # raises ApiError (a 400) on a body the gateway refuses

    check()


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "x", "top_k": -2},  # -1 and 0 are off (vLLM's), below is refused
    {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
    {"model": "m", "prompt": "x", "seed": -1},
    {"model": "m", "prompt": "x", "echo": "yes"},
    {"model": "m", "prompt": "x", "max_tokens": 0},  # 0 only to score the prompt (echo, prompt_logprobs)
    {"model": "m", "prompt": "x", "prompt_logprobs": 21},
    {"model": "", "prompt": "x"},
    {"model": "m", "prompt": "x", "stop_token_ids": [-1]},
    {"model": "m", "prompt": "x", "max_tokens": 2**31},
])
def test_bodies_the_gateway_refuses_are_outside_the_schema(body):
    import jsonschema

    with pytest.raises(oa.ApiError):
        oa.parse_completion(body)
    assert not jsonschema.Draft202012Validator(schema("CompletionRequest")).is_valid(body)


@pytest.mark.parametrize("name, endpoint", [("CompletionRequest", "/v1/completions"),
                                             ("ChatCompletionRequest", "/v1/chat/completions")])
def test_the_schema_lists_exactly_the_fields_the_gateway_takes(name, endpoint):
    """Any other field is refused (request_fields.refuse_unknown), and the schema says so."""
    from services.gateway.request_fields import KNOWN_FIELDS

    body_schema = schema(name)
    assert set(body_schema["properties"]) == KNOWN_FIELDS[endpoint]
    assert body_schema["additionalProperties"] is False
    body = {"model": "m", "prompt": "x"} if endpoint == "/v1/completions" else \
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    parse = oa.parse_completion if endpoint == "/v1/completions" else oa.parse_chat
    with pytest.raises(oa.ApiError, match="Unrecognized request argument supplied: 'frobnicate'"):
        parse({**body, "frobnicate": 1})


def test_chat_top_logprobs_needs_logprobs_in_both():
    import jsonschema

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    with pytest.raises(oa.ApiError):
        oa.parse_chat(body)
    assert not jsonschema.Draft202012Validator(schema("ChatCompletionRequest")).is_valid(body)
    oa.parse_chat({**body, "logprobs": True})
