"""One SamplingParams (shared.protocol) for the gateway, the wire and the engine: a request the
gateway parses is encoded, decoded and run by the engine as that one object, and what the engine
derives from it stays off the wire."""

import pickle

import msgspec
import pytest

import services.engine
from services.engine import LLM, sampling_params
from services.gateway.openai_api import parse_completion
from shared import protocol
from shared.protocol import GenerateRequest, ProtocolError, SamplingParams

# Every field BUILTIN_DEFAULTS fills set, so resolving it keeps the very object.
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
        "min_p": 0.0, "repetition_penalty": 1.0, "bad_words": ["the"], "min_tokens": 3}


def wire_request(sampling: SamplingParams) -> tuple[GenerateRequest, bytes]:
    raw = protocol.encode(GenerateRequest("r", "tiny", "_INBOX.r", prompt_token_ids=[5, 6, 7, 8], sampling=sampling))
    return protocol.decode(GenerateRequest, raw), raw


def test_the_gateway_the_wire_and_the_engine_name_one_class():
    assert services.engine.SamplingParams is sampling_params.SamplingParams is SamplingParams
    parsed = parse_completion(BODY)
    assert type(parsed.sampling) is SamplingParams
    assert type(wire_request(parsed.sampling)[0].sampling) is SamplingParams
    names = {f.name for f in msgspec.structs.fields(SamplingParams)}
    assert not names & {"bad_words_token_ids", "min_tokens_masked_ids"}  # the engine's, on its Sequence


def test_a_decoded_request_runs_as_decoded_and_what_the_engine_derives_stays_off_the_wire(tiny_model_dir):
    decoded, raw = wire_request(parse_completion(BODY).sampling)
    llm = LLM(tiny_model_dir)
    llm.engine.add_request("r", decoded.prompt_token_ids, decoded.sampling)
    seq = llm.engine.requests["r"]
    assert seq.params is decoded.sampling  # no conversion and no copy
    assert seq.processors.bad_words_token_ids and seq.processors.min_tokens_masked_ids
    assert protocol.encode(decoded) == raw  # nothing was added to the parameters
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert seq.is_finished and seq.num_output_tokens == 6

    # An unset field is filled from the model's defaults into a copy: the request's stays unset.
    unset, _ = wire_request(SamplingParams(max_tokens=2))
    llm.engine.add_request("unset", unset.prompt_token_ids, unset.sampling)
    assert unset.sampling.temperature is None and llm.engine.requests["unset"].params.temperature is not None
    assert llm.engine.requests["unset"].processors is None  # neither bad_words nor min_tokens


def test_the_engine_api_of_the_one_class():
    assert SamplingParams(stop="\n").stop == ["\n"] and SamplingParams(stop=None).stop == []
    params = SamplingParams(temperature=0, max_tokens=32, seed=3, stop_token_ids=(7,), logit_bias={4: 1.5})
    assert params.stop_token_ids == [7] and params.resolved().greedy and not params.resolved().needs_penalties
    assert pickle.loads(pickle.dumps(params, pickle.HIGHEST_PROTOCOL)) == params  # to the core process
    assert msgspec.structs.replace(params, n=2).n == 2 and params.n == 1
    with pytest.raises(sampling_params.InvalidRequestError) as err:
        sampling_params.check(SamplingParams(stop_token_ids=[99]).resolved(), vocab_size=50)
    assert err.value.param == "stop_token_ids"
    with pytest.raises(ProtocolError, match="sampling.stop"):  # a bare string is the constructor's, not the wire's
        protocol.decode(GenerateRequest, msgspec.msgpack.encode(
            {"v": 1, "request_id": "r", "model": "m", "reply_to": "x", "prompt": "p", "sampling": {"stop": "\n"}}))
