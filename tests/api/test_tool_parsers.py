"""The tool call parsers and tool request parsing (pure: no stack). Streamed text is cut where
a real tokenizer cuts it (the tiny model's, token by token), and every reply is read both in
pieces and whole: the two must agree."""

import json

import jsonschema
import pytest

from services.control.spec import SpecError, validate
from services.gateway.__main__ import parse_tool_call_parsers
from services.gateway.openai_api import ApiError, parse_chat
from services.gateway.tool_parsers import (CallDelta, Content, HermesParser, Llama3JsonParser, NamedCall,
                                           RequiredCalls, UnknownToolParser, assemble, delta)
from services.gateway.tools import required_schema
from shared.deployments import DeploymentSpec

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
             "zone": {"type": "string"}}, "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` as a stream delivers it: the decoded text growing token by token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, sent = [], ""
    for n in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:n])
        if now.endswith("\ufffd"):
            continue
        pieces.append(now[len(sent):])
        sent = now
    assert "".join(pieces) == text
    return pieces


def read(parser_factory, tokenizer, text: str):
    """The reply read in token-sized pieces and whole; both must agree (ids aside)."""
    parser = parser_factory()
    streamed = [e for piece in token_pieces(tokenizer, text) for e in parser.feed(piece)] + parser.finish()
    parser = parser_factory()
    whole = assemble(parser.feed(text) + parser.finish())
    pieces = assemble(streamed)
    strip = lambda calls: [{**c, "id": None} for c in calls]  # noqa: E731
    assert (pieces.content, strip(pieces.tool_calls)) == (whole.content, strip(whole.tool_calls))
    return whole, streamed


def test_hermes_reads_content_then_calls(tokenizer):
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    reply, streamed = read(HermesParser, tokenizer, text)
    assert reply.content == "Let me look."
    assert [c["function"]["name"] for c in reply.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in reply.tool_calls)
    assert len({c["id"] for c in reply.tool_calls}) == 2
    # Content streams before the call is complete; no piece of a tag leaks into it.
    assert isinstance(streamed[0], Content) and "<" not in "".join(e.text for e in streamed if isinstance(e, Content))
    assert [e.index for e in streamed if isinstance(e, CallDelta)] == [0, 1]


def test_hermes_without_calls_is_content_unchanged(tokenizer):
    text = "No tools needed: 2 < 3 and <tool is not a tag.\n"
    reply, _ = read(HermesParser, tokenizer, text)
    assert reply.content == text and reply.tool_calls == []


def test_hermes_unreadable_call_comes_back_as_content(tokenizer):
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    reply, _ = read(HermesParser, tokenizer, text)
    assert reply.tool_calls == [] and reply.content == text
    cut = 'x<tool_call>\n{"name": "get_time", "arguments": {"zone": "U'  # cut short by max_tokens
    reply, _ = read(HermesParser, tokenizer, cut)
    assert reply.tool_calls == [] and reply.content == cut


def test_hermes_arguments_as_a_json_string_and_parallel_off(tokenizer):
    text = ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    reply, _ = read(lambda: HermesParser(max_calls=1), tokenizer, text)
    assert reply.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == [
        ("get_time", {"zone": "UTC"})]


def test_llama3_json(tokenizer):
    text = ('{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {"zone": "CET"}}')
    reply, _ = read(Llama3JsonParser, tokenizer, text)
    assert reply.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})]
    reply, _ = read(Llama3JsonParser, tokenizer, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "X"}}')
    assert [c["function"]["name"] for c in reply.tool_calls] == ["get_time"]


def test_llama3_json_plain_text_streams_through(tokenizer):
    parser = Llama3JsonParser()
    assert parser.feed("The") == [Content("The")]  # not JSON: content at once, not at the end
    assert parser.feed(" answer {x}") == [Content(" answer {x}")]
    assert parser.finish() == []
    reply, _ = read(Llama3JsonParser, tokenizer, '{"not": "a call"} and more')
    assert reply.tool_calls == [] and reply.content == '{"not": "a call"} and more'


def test_required_and_named(tokenizer):
    text = '[{"name": "get_weather", "parameters": {"city": "Lima"}}, {"name": "get_time", "parameters": {"zone": "PET"}}]'
    reply, _ = read(RequiredCalls, tokenizer, text)
    spaced, _ = read(RequiredCalls, tokenizer, text.replace("[", " [\n  ").replace(", {", " ,\n {"))  # JSON's whitespace
    assert spaced.content is None and len(spaced.tool_calls) == 2
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Lima"}), ("get_time", {"zone": "PET"})]
    parser = NamedCall("get_weather")
    first = parser.feed('{"city"')
    assert delta(first[0])["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert delta(parser.feed(': "Nice"}')[0]) == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Nice"}'}}]}
    reply, _ = read(lambda: NamedCall("get_weather"), tokenizer, '{"city": "Nice"}')
    assert reply.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Nice"}'}


def test_required_schema_accepts_only_the_functions_calls():
    functions = {t["function"]["name"]: [t["function"]["parameters"]] for t in TOOLS}
    schema = required_schema(functions, parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {"zone": "UTC"}}],
                  [{"name": "nope", "parameters": {}}], {"name": "get_time", "parameters": {"zone": "UTC"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate([{"name": "get_time", "parameters": {"zone": "A"}}] * 2, required_schema(functions, False))


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_tool_choice_sets_the_structured_schema():
    parsed, _ = parse_chat(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(parsed.sampling.structured.json) == WEATHER
    parsed, _ = parse_chat(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert json.loads(parsed.sampling.structured.json)["maxItems"] == 1
    for choice in (None, "auto", "none"):
        parsed, _ = parse_chat(chat(tools=TOOLS, tool_choice=choice))
        assert parsed.sampling.structured is None and parsed.tools.choice == (choice or "auto")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
])
def test_bad_tool_fields_are_refused_naming_them(fields, param):
    with pytest.raises(ApiError) as err:
        parse_chat(chat(**fields))
    assert err.value.status == 400 and err.value.param == param


def test_messages_keep_tool_calls_for_the_template():
    _, messages = parse_chat(chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]))
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_unknown_parser_is_refused_naming_it():
    with pytest.raises(UnknownToolParser, match="'mistral_v9'"):
        parse_tool_call_parsers(["mistral_v9"])
    assert parse_tool_call_parsers(["hermes", "other=llama3_json"]) == {"": "hermes", "other": "llama3_json"}
    with pytest.raises(SpecError) as err:
        validate({"name": "d", "model": "/m", "tool_call_parser": "mistral_v9"}, check_model=False)
    assert any(field == "tool_call_parser" and "mistral_v9" in reason for field, reason in err.value.errors)
    spec = validate({"name": "d", "model": "/m", "tool_call_parser": "hermes"}, check_model=False)
    assert DeploymentSpec.from_dict(json.loads(spec.to_json())).tool_call_parser == "hermes"  # as stored
