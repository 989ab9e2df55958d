"""The protocol decoder: valid messages round-trip; anything malformed raises ProtocolError only."""

import random

import msgpack
import pytest

from shared import protocol
from shared.protocol import (Cancel, GenerateRequest, KvBlockStored, KvEventBatch, ProtocolError,
                             SamplingParams, TokenChunk, Usage)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def valid_request() -> GenerateRequest:
    return GenerateRequest(request_id="r1", model="tiny", reply_to="_INBOX.x", prompt="hi",
                           sampling=SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]))


def test_round_trip_keeps_every_field():
    req = valid_request()
    assert protocol.decode(GenerateRequest, protocol.encode(req)) == req
    chunk = TokenChunk(request_id="r1", seq=3, token_ids=[1, 2], text="ab", finish_reason="stop",
                       usage=Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=4),
                       timings={"prefill": 0.01})
    back = protocol.decode(TokenChunk, protocol.encode(chunk))
    assert back == chunk and back.is_final
    batch = KvEventBatch(replica_id="e0", model="m", seq=7,
                         stored=[KvBlockStored(block_hash=2**63 + 5, parent_hash=None)], removed=[9])
    assert protocol.decode(KvEventBatch, protocol.encode(batch)) == batch


def test_unknown_fields_are_ignored():
    payload = valid_request().to_dict() | {"v": 1, "future_field": {"x": 1}}
    assert protocol.decode(GenerateRequest, pack(payload)).request_id == "r1"


def test_int_is_accepted_where_a_float_is_expected():
    payload = valid_request().to_dict() | {"v": 1}
    payload["sampling"]["temperature"] = 1
    assert protocol.decode(GenerateRequest, pack(payload)).sampling.temperature == 1.0


@pytest.mark.parametrize("payload, needle", [
    (b"\xc1", "not valid msgpack"),
    (b"", "not valid msgpack"),
    (pack([1, 2, 3]), "expected a map"),
    (pack({"request_id": "r", "model": "m", "reply_to": "x", "prompt": "p"}), "missing schema version"),
    (pack({"v": 99, "request_id": "r", "model": "m", "reply_to": "x", "prompt": "p"}), "unsupported schema version"),
    (pack({"v": "1", "request_id": "r", "model": "m", "reply_to": "x", "prompt": "p"}), "unsupported schema version"),
    (pack({"v": 1, "model": "m", "reply_to": "x", "prompt": "p"}), "missing required field 'request_id'"),
    (pack({"v": 1, "request_id": 5, "model": "m", "reply_to": "x", "prompt": "p"}), "request_id: expected str"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "x"}), "one of 'prompt' or 'prompt_token_ids'"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "x", "prompt_token_ids": [1, "a"]}),
     "prompt_token_ids[1]: expected an integer"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "x", "prompt": "p",
           "sampling": {"max_tokens": True}}), "sampling.max_tokens: expected an integer"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "x", "prompt": "p",
           "sampling": "greedy"}), "sampling: expected a map"),
    (pack({"v": 1, "request_id": "", "model": "m", "reply_to": "x", "prompt": "p"}), "request_id must not be empty"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "x", "prompt": "p", "deadline": float("nan")}),
     "finite number"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "x", "prompt_token_ids": [2**63]}), "[0, 2**63)"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "a.*", "prompt": "p"}), "not a valid subject"),
    (pack({"v": 1, "request_id": "r", "model": "m", "reply_to": "x", "prompt": "p", "sampling": {"top_k": 2**64 - 1}}),
     "64-bit range"),
])
def test_malformed_payloads_raise_the_clear_error(payload, needle):
    with pytest.raises(ProtocolError) as info:
        protocol.decode(GenerateRequest, payload)
    assert needle in str(info.value)


@pytest.mark.parametrize("fields, needle", [
    ({"priority": "ultra"}, "priority 'ultra'"),
    ({"sampling": {"top_k": -2}}, "top_k must be -1 or 0 (off), or in [1,"),  # vLLM's: 0 is off too
    ({"sampling": {"seed": -1}}, "seed must be >= 0"),
    ({"sampling": {"max_tokens": 0}}, "max_tokens must be in [1,"),
    ({"sampling": {"max_tokens": 2**31}}, "max_tokens must be in [1,"),
    ({"sampling": {"logprobs": 21}}, "logprobs must be in [0, 20]"),
])
def test_out_of_range_values_are_refused_and_the_caller_can_be_told(fields, needle):
    """Well-formed but out of range: an InvalidRequest that names the request and its reply_to,
    so a receiver tells the caller even without a NATS reply subject."""
    payload = {"v": 1, "request_id": "r9", "model": "m", "reply_to": "_INBOX.client.r9", "prompt": "p", **fields}
    with pytest.raises(protocol.InvalidRequest) as info:
        protocol.decode(GenerateRequest, pack(payload))
    assert needle in str(info.value) and (info.value.request_id, info.value.reply_to) == ("r9", "_INBOX.client.r9")


def test_oversized_payload_is_rejected_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(Cancel, b"\x00" * (protocol.MAX_PAYLOAD_BYTES + 1))


def test_garbage_and_truncations_only_ever_raise_protocol_error():
    rng = random.Random(1234)
    good = protocol.encode(valid_request())
    samples = [good[:i] for i in range(len(good))]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(500)]
    for i in range(300):  # flip bytes of a valid payload
        b = bytearray(good)
        b[rng.randrange(len(b))] = rng.randrange(256)
        samples.append(bytes(b))
    for data in samples:
        for cls in (GenerateRequest, TokenChunk, Cancel, KvEventBatch):
            try:
                protocol.decode(cls, data)
            except ProtocolError:
                pass


def test_subject_tokens_are_checked():
    assert protocol.engine_generate("e-1") == "strata.v1.engine.e-1.generate"
    assert protocol.kv_events("tiny", "e-1") == "strata.v1.kv.tiny.e-1"
    for bad in ["", "a.b", "a*", ">", "a b"]:
        with pytest.raises(ValueError):
            protocol.heartbeat(bad)


def test_nil_means_the_default_and_unknown_nested_fields_are_ignored():
    payload = valid_request().to_dict() | {"v": 1, "priority": None, "timestamps": None}
    payload["sampling"] |= {"max_tokens": None, "stop": None, "n": None, "skip_special_tokens": None,
                            "future_knob": [1, 2]}
    req = protocol.decode(GenerateRequest, pack(payload))
    assert (req.sampling.max_tokens, req.sampling.stop, req.sampling.n, req.timestamps) == (16, [], 1, {})
    assert req.sampling.skip_special_tokens is True
    assert TokenChunk(request_id="r", seq=0, text=None).text == ""  # the same when built in code


@pytest.mark.parametrize("where", ["timestamps", "deadline", "sampling.temperature", "sampling.logit_bias"])
def test_non_finite_numbers_are_refused_wherever_they_are(where):
    payload = valid_request().to_dict() | {"v": 1}
    value = {"timestamps": {"gateway_received": float("inf")}, "deadline": float("-inf"),
             "sampling.temperature": float("nan"), "sampling.logit_bias": {3: float("nan")}}[where]
    if where.startswith("sampling."):
        payload["sampling"][where.split(".")[1]] = value
    else:
        payload[where] = value
    with pytest.raises(ProtocolError, match="finite number"):
        protocol.decode(GenerateRequest, pack(payload))


def test_text_options_cross_the_wire():
    """skip_special_tokens and include_stop_str_in_output, set to their non-defaults, arrive."""
    req = valid_request()
    req.sampling.skip_special_tokens, req.sampling.include_stop_str_in_output = False, True
    back = protocol.decode(GenerateRequest, protocol.encode(req)).sampling
    assert (back.skip_special_tokens, back.include_stop_str_in_output) == (False, True)


def test_the_version_is_on_messages_sent_alone_and_nested_ones_need_none():
    chunk = TokenChunk(request_id="r1", seq=0, token_ids=[5], text="a")
    assert msgpack.unpackb(protocol.encode(chunk)) == {"v": 1, "request_id": "r1", "seq": 0, "token_ids": [5],
                                                       "text": "a"}  # defaults are not sent
    batch = {"v": 1, "replica_id": "e0", "chunks": [{"request_id": "r1", "seq": 0}, {"request_id": "r2", "seq": 4}]}
    decoded = protocol.decode(protocol.TokenChunkBatch, pack(batch))
    assert [c.request_id for c in decoded.chunks] == ["r1", "r2"] and decoded.chunks[1].token_ids == []
    with pytest.raises(ProtocolError, match="unsupported schema version"):
        protocol.decode(protocol.TokenChunkBatch, pack(batch | {"v": 0}))
    with pytest.raises(TypeError):  # a part of a message is never a payload of its own
        protocol.decode(Usage, pack({"v": 1, "prompt_tokens": 1, "completion_tokens": 1}))


def test_from_dict_checks_as_decode_does():
    req = valid_request()
    assert GenerateRequest.from_dict(req.to_dict()) == req
    with pytest.raises(ProtocolError, match="sampling.max_tokens: expected an integer"):
        GenerateRequest.from_dict(req.to_dict() | {"sampling": {"max_tokens": "8"}})
