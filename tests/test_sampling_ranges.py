"""One table of sampling ranges (shared.sampling_ranges): the gateway's request parsing, its
OpenAPI schema, the wire's GenerateRequest.validate and the engine's SamplingParams.validate
accept exactly the same values, probed at and around every bound; the semantics are vLLM's."""

import jsonschema
import msgpack
import pytest

from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.gateway import openai_api as oa
from services.gateway.openapi import openapi_spec
from shared import protocol
from shared.sampling_ranges import INT32_MAX, INT64_MAX, RANGES

VOCAB = 2**31  # no token-id bound of the engine's gets in the way of the ranges


def probes(name: str) -> list:
    r = RANGES[name]
    values = [r.lo, r.hi, *r.off, -1, 0, 1, 2**31, INT64_MAX]
    if r.integer:
        values += [r.lo - 1, (r.hi or INT64_MAX) + 1, 1.5, True]
    else:
        values += [r.lo - 0.01, r.lo + 1e-9, (r.hi or 1e300) + 0.01, 2.0, 2.0000001, 10.0, 100.0, 1e300]
    return [v for v in dict.fromkeys(values) if v is not None]


def body(name: str, value) -> dict:
    return {"model": "m", "prompt": "x", name: value}


def gateway_accepts(name: str, value) -> bool:
    try:
        oa.parse_completion(body(name, value))
    except oa.ApiError as exc:
        assert exc.param == name, exc.message
        return False
    return True


def wire_accepts(name: str, value) -> bool:
    payload = {"v": 1, "request_id": "r", "model": "m", "reply_to": "_INBOX.r", "prompt": "x",
               "sampling": {name: value}}
    try:
        protocol.decode(protocol.GenerateRequest, msgpack.packb(payload))
    except protocol.InvalidRequest as exc:
        assert f"sampling.{name} " in str(exc)
        return False
    except protocol.ProtocolError:  # a value of the wrong type, or past 64 bits: malformed
        return False
    return True


def engine_accepts(name: str, value) -> bool:
    try:
        SamplingParams(**{name: value}).resolved().validate(VOCAB)
    except InvalidRequestError as exc:
        assert exc.param == name, exc
        return False
    return True


def schema_accepts(name: str, value) -> bool:
    spec = openapi_spec()
    schema = {**spec["components"]["schemas"]["CompletionRequest"], "components": spec["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(body(name, value))


GATEWAY_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "logprobs", "prompt_logprobs", "min_tokens"]


@pytest.mark.parametrize("name", sorted(RANGES))
def test_every_layer_accepts_exactly_the_table(name):
    disagreements = []
    for value in probes(name):
        expected = RANGES[name].contains(value)
        if name == "min_tokens" and isinstance(value, int) and not isinstance(value, bool) and value > 16:
            expected = False  # at most max_tokens (16 by default): a rule between fields, the same everywhere
        seen = {"wire": wire_accepts(name, value), "engine": engine_accepts(name, value)}
        if name in GATEWAY_FIELDS:
            seen["gateway"] = gateway_accepts(name, value)
            if name != "min_tokens":
                seen["openapi"] = schema_accepts(name, value)
        if any(ok != expected for ok in seen.values()):
            disagreements.append((value, expected, seen))
    assert not disagreements


def test_vllm_semantics():
    """temperature in [0, 2]; top_k -1 and 0 are off; repetition_penalty any positive number."""
    for value in (-1, 0):
        assert gateway_accepts("top_k", value) and wire_accepts("top_k", value) and engine_accepts("top_k", value)
    assert not engine_accepts("top_k", -2)
    assert engine_accepts("temperature", 2.0) and not engine_accepts("temperature", 2.5)
    assert gateway_accepts("repetition_penalty", 50.0) and engine_accepts("repetition_penalty", 50.0)
    assert not engine_accepts("repetition_penalty", 0.0)
    assert engine_accepts("top_k", INT32_MAX) and not engine_accepts("top_k", INT32_MAX + 1)


def test_rules_between_fields_are_the_same_at_every_layer():
    # min_tokens above max_tokens, max_tokens 0 without prompt logprobs, n > 1 with max_tokens 0.
    with pytest.raises(oa.ApiError) as info:
        oa.parse_completion({"model": "m", "prompt": "x", "max_tokens": 4, "min_tokens": 5})
    assert info.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=4, min_tokens=5).resolved().validate(VOCAB)
    assert err.value.param == "min_tokens"
    for sampling, needle in (({"max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens"),
                             ({"max_tokens": 0}, "sampling.max_tokens"),
                             ({"max_tokens": 0, "prompt_logprobs": 0, "n": 2}, "sampling.n"),
                             ({"logit_bias": {5: 101.0}}, "sampling.logit_bias")):
        payload = {"v": 1, "request_id": "r", "model": "m", "reply_to": "_INBOX.r", "prompt": "x", "sampling": sampling}
        with pytest.raises(protocol.InvalidRequest, match=needle):
            protocol.decode(protocol.GenerateRequest, msgpack.packb(payload))
    # A chat request without max_tokens gets it from the service (as many as fit): min_tokens is
    # checked then, by the wire, not against the placeholder.
    parsed, _ = oa.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "min_tokens": 40})
    assert parsed.sampling.min_tokens == 40
