"""Structured outputs in the engine (services.engine.structured), on the tiny model: its random
weights make unconstrained output noise, so valid output shows the mask at work.

- 10 JSON schemas: every output parses and validates (jsonschema), seeded and greedy;
- regex, choice and EBNF grammar outputs match; json_object output is a JSON object, or (cut
  off by max_tokens: random weights rarely close a free-form string) a prefix of one;
- an uncompilable schema / regex / grammar is an InvalidRequestError naming the field, with the
  library's reason, and the engine keeps serving; grammars are compiled once (cached by spec);
- a resumed stream (protocol.Resume) replays its delivered tokens into its matcher and continues
  in the same grammar state: its output equals the uninterrupted one and validates;
- speculative decoding drafts nothing for structured sequences;
- the torch mask path (bf16 logits, any device) equals xgrammar's CPU kernel.
"""

import json

import jsonschema
import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.config import EngineArgs
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import InvalidRequestError
from services.engine.structured import StepMasks, apply_masks
from shared.protocol import StructuredSpec
from tests.engine.conftest import assert_no_leak

# Small enough for random weights to close them: bounded strings, integers and arrays.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
                                               "items": {"type": "string", "minLength": 1, "maxLength": 4}}},
     "required": ["tags"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                          {"type": "null"}]}}, "required": ["value"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "id": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "done": {"type": "boolean"}}, "required": ["kind", "id", "done"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 5},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_kv_blocks=512)


def structured(max_tokens=MAX_TOKENS, **spec) -> dict:
    return dict(max_tokens=max_tokens, structured=StructuredSpec(**spec))


def test_ten_json_schemas_give_valid_json(llm):
    params = [SamplingParams(temperature=1.0, seed=seed, **structured(json=json.dumps(schema)))
              for schema in SCHEMAS for seed in (0, 1)]
    params += [SamplingParams(temperature=0.0, **structured(json=json.dumps(schema))) for schema in SCHEMAS]
    outs = llm.generate(["Answer in JSON:"] * len(params), params)
    schemas = [s for s in SCHEMAS for _ in (0, 1)] + SCHEMAS
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    unconstrained = llm.generate("Answer in JSON:", SamplingParams(temperature=1.0, seed=0, max_tokens=20))[0]
    with pytest.raises(ValueError):  # noise without the mask
        json.loads(unconstrained.outputs[0].text)
    assert_no_leak(llm.engine)


def test_regex_choice_and_grammar(llm):
    import re

    regex = r"[a-z]{3,6}-[0-9]{2}"
    choices = ["yes", "no", "maybe not"]
    grammar = 'root ::= "(" digit ("+" digit)? ")"\ndigit ::= [0-9]'
    params = [SamplingParams(temperature=1.0, seed=s, **structured(regex=regex)) for s in range(4)]
    params += [SamplingParams(temperature=1.0, seed=s, **structured(choice=choices)) for s in range(4)]
    params += [SamplingParams(temperature=1.0, seed=s, **structured(grammar=grammar)) for s in range(4)]
    outs = [o.outputs[0] for o in llm.generate(["Say it:"] * len(params), params)]
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(re.fullmatch(regex, o.text) for o in outs[:4]), [o.text for o in outs[:4]]
    assert all(o.text in choices for o in outs[4:8])
    assert all(re.fullmatch(r"\([0-9](\+[0-9])?\)", o.text) for o in outs[8:]), [o.text for o in outs[8:]]


def json_prefix_ok(text: str) -> bool:
    """Whether text is a prefix of some JSON document: completed by closing an open string, a
    value after a dangling key or separator, and the open brackets."""
    stack, in_string, escape = [], False, False
    for ch in text:
        if in_string:
            escape, in_string = (not escape and ch == "\\"), in_string and not (ch == '"' and not escape)
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return False
    closers = "".join(reversed(stack))
    for head in (['"'] if in_string else [""]):
        for middle in ("", ':0', '0', '"":0', 'rue', 'alse', 'ull', 'e0'):
            try:
                json.loads(text + head + middle + closers)
                return True
            except ValueError:
                pass
    return False


def test_json_object_is_an_object_or_a_prefix_of_one(llm):
    params = [SamplingParams(temperature=1.0, seed=s, **structured(max_tokens=48, json_object=True)) for s in range(6)]
    for out in llm.generate(["JSON:"] * len(params), params):
        c = out.outputs[0]
        assert c.text.lstrip().startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert json_prefix_ok(c.text), c.text
    assert not json_prefix_ok('{"a": 1}}') and not json_prefix_ok("[1, 2}")  # the check can fail


@pytest.mark.parametrize("spec,reason", [
    (dict(json='{"type": 5}'), "Type should be a string"),
    (dict(json='{"properties": {"a": {"$ref": "#/nope"}}}'), "nope"),
    (dict(regex="(ab"), "parenthesis"),
    (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
])
def test_an_uncompilable_spec_is_refused_and_the_engine_keeps_serving(llm, spec, reason):
    kind = next(iter(spec))
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("x", SamplingParams(**structured(**spec)))
    assert info.value.param == f"structured_outputs.{kind}" and reason in str(info.value)
    assert not llm.engine.requests
    out = llm.generate("x", SamplingParams(temperature=0.0, **structured(choice=["a", "b"])))[0]
    assert out.outputs[0].text in ("a", "b")


def test_grammars_are_compiled_once(llm):
    so = llm.engine.structured
    spec = dict(json=json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}},
                                 "required": ["n"]}))
    misses = so.cache_misses
    llm.generate(["a", "b", "c"], SamplingParams(temperature=0.0, **structured(**spec)))
    llm.generate("d", SamplingParams(temperature=0.0, **structured(**spec)))
    assert so.cache_misses == misses + 1 and so.cache_hits >= 4


def run(engine, rid, limit=None):
    """Step the engine; (delivered ids, delivered text, finish reason) of request rid."""
    ids, text, reason, steps = [], "", None, 0
    while engine.has_unfinished_requests() and (limit is None or steps < limit):
        for out in engine.step():
            if out.request_id == rid:
                ids += out.new_token_ids
                text += out.text_delta
                reason = out.outputs[0].finish_reason
        steps += 1
    return ids, text, reason


def test_a_resumed_stream_continues_in_the_same_grammar_state(tiny_model_dir):
    schema = SCHEMAS[9]
    spec = StructuredSpec(json=json.dumps(schema))
    engine = LLMEngine(tiny_model_dir, EngineArgs(num_kv_blocks=256))
    prompt = engine.tokenizer.encode("Order:")

    def params(max_tokens=MAX_TOKENS):
        return SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, structured=spec)

    engine.add_request("whole", prompt, params())
    whole, whole_text, reason = run(engine, "whole")
    assert reason == "stop"
    jsonschema.validate(json.loads(whole_text), schema)
    # The first leg: a few tokens, then its replica is lost; the second resumes from them.
    engine.add_request("first", prompt, params())
    sent, text, _ = run(engine, "first", limit=6)
    engine.abort_request("first")
    engine.step()
    assert 3 <= len(sent) < len(whole)
    engine.add_processed("second", None, prompt + sent, engine.inputs.process(prompt + sent, params(
        MAX_TOKENS - len(sent)))[2], resumed=(len(sent), len(text)))
    assert engine.requests["second"].grammar is not None
    rest, rest_text, reason = run(engine, "second")
    assert reason == "stop" and sent + rest == whole and text + rest_text == whole_text
    jsonschema.validate(json.loads(text + rest_text), schema)
    # Tokens the grammar never allowed cannot be resumed: refused, nothing queued.
    bad = engine.tokenizer.encode("not json", add_special_tokens=False)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_processed("third", None, prompt + bad, params(), resumed=(len(bad), 8))
    assert info.value.param == "structured_outputs.json" and "third" not in engine.requests
    assert_no_leak(engine)


def test_speculative_decoding_drafts_nothing_for_structured_sequences(tiny_model_dir):
    spec_config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "adaptive": False}
    llm = LLM(tiny_model_dir, num_kv_blocks=256, speculative_config=spec_config)
    prompt = '{"name": "ab", "age": 12} {"name": "ab", "age": 12} {"name": '
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, **structured(json=json.dumps(SCHEMAS[0]))),
                                           SamplingParams(temperature=0.0, max_tokens=24)])
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMAS[0])
    assert outs[0].metrics.num_draft_tokens == 0
    assert outs[1].metrics.num_draft_tokens > 0  # the plain one beside it still speculates
    assert_no_leak(llm.engine)


def test_the_torch_mask_path_equals_the_xgrammar_kernel(llm):
    so = llm.engine.structured
    matchers = [so.matcher(StructuredSpec(json=json.dumps(SCHEMAS[0]))), so.matcher(StructuredSpec(regex="[0-9]+"))]

    class Row:
        def __init__(self, grammar):
            self.grammar = grammar

    masks = so.prepare_masks([Row(None), Row(matchers[0]), Row(matchers[1])], torch.device("cpu"))
    assert masks.rows == [1, 2]
    vocab = so.vocab_size
    logits = torch.randn(3, vocab)
    kernel = apply_masks(logits.clone(), masks, vocab)
    torch_path = apply_masks(logits.to(torch.bfloat16), StepMasks(masks.rows, masks.bitmask), vocab)
    assert torch.equal(kernel.isinf(), torch_path.isinf())
    assert not kernel[0].isinf().any() and 0 < int((~kernel[2].isinf()).sum()) < vocab


def test_the_spec_on_the_wire():
    from shared.protocol import GenerateRequest, ProtocolError, SamplingParams, decode, encode

    req = GenerateRequest("r", "m", "reply", prompt="x",
                          sampling=SamplingParams(structured=StructuredSpec(choice=["a", "b"])))
    back = decode(GenerateRequest, encode(req))
    assert back.sampling.structured == StructuredSpec(choice=["a", "b"]) and back.sampling.structured.kind == "choice"
    for bad in ({"regex": "a", "choice": ["a"]}, {}, {"choice": []}, {"json_object": False}):
        with pytest.raises(ProtocolError):
            GenerateRequest.from_dict({**req.to_dict(), "sampling": {"structured": bad}})
