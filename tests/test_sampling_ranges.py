"""One table of sampling ranges (shared.sampling_ranges): the gateway's request parsing, its
OpenAPI schema, the wire's GenerateRequest.validate and the engine's sampling_params.check
accept exactly the same values, probed at and around every bound; the semantics are vLLM's."""

import jsonschema
import msgpack
import pytest

from services.engine.sampling_params import InvalidRequestError, SamplingParams, check
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


def fields(name: str, value) -> dict:
    # min_tokens: with room for it (at most max_tokens is a rule between fields, the engine's).
    return {name: value, **({"max_tokens": INT32_MAX} if name == "min_tokens" else {})}


def body(name: str, value) -> dict:
    return {"model": "m", "prompt": "x", **fields(name, value)}


def gateway_accepts(name: str, value) -> bool:
    try:
        oa.parse_completion(body(name, value))
    except oa.ApiError as exc:
        assert exc.param == name, exc.message
        return False
    return True


def wire_accepts(name: str, value) -> bool:
    payload = {"v": 1, "request_id": "r", "model": "m", "reply_to": "_INBOX.r", "prompt": "x",
               "sampling": fields(name, value)}
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
        check(SamplingParams(**fields(name, value)).resolved(), VOCAB)
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


def test_rules_between_fields():
    """max_tokens 0 only with prompt logprobs, everywhere; min_tokens at most max_tokens and n 1
    with max_tokens 0 at the engine (a resumed stream's leg carries the max_tokens left, so the
    wire cannot hold min_tokens to it; the gateway's OpenAPI schema cannot say them either)."""
    with pytest.raises(oa.ApiError) as info:
        oa.parse_completion(body("max_tokens", 0))
    assert info.value.param == "max_tokens"
    assert oa.parse_completion({**body("max_tokens", 0), "echo": True}).sampling.prompt_logprobs == 0
    for params, param in ((dict(max_tokens=4, min_tokens=5), "min_tokens"), (dict(max_tokens=0), "max_tokens"),
                          (dict(max_tokens=0, prompt_logprobs=0, n=2), "n"), (dict(logit_bias={5: 101.0}), "logit_bias")):
        with pytest.raises(InvalidRequestError) as err:
            check(SamplingParams(**params).resolved(), VOCAB)
        assert err.value.param == param
    for sampling, refused in (({"max_tokens": 0}, "sampling.max_tokens"), ({"logit_bias": {5: 101.0}}, "sampling.logit_bias"),
                              ({"max_tokens": 4, "min_tokens": 5}, None), ({"max_tokens": 0, "prompt_logprobs": 0, "n": 2}, None)):
        payload = {"v": 1, "request_id": "r", "model": "m", "reply_to": "_INBOX.r", "prompt": "x", "sampling": sampling}
        if refused:
            with pytest.raises(protocol.InvalidRequest, match=refused):
                protocol.decode(protocol.GenerateRequest, msgpack.packb(payload))
        else:
            protocol.decode(protocol.GenerateRequest, msgpack.packb(payload))
