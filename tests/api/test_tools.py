"""Tool calling through the real stack with the official `openai` client (issue 18).

`required` and a named tool_choice are enforced by structured output: with random weights the
model's own text is noise, so arguments that validate against the function's schema show the
constraint works. `auto` is read from the model's text by the deployment's parser: a reply in
hermes format comes from the model under a regex constraint (structured_outputs), so the
parser reads what the engine really streamed. A second gateway, on the same bus and engine,
serves the model with `--tool-call-parser hermes`; the package's gateway has no parser."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import jsonschema
import openai
import pytest

from shared.localstack import free_port

from .conftest import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]



@pytest.fixture(scope="module")
def tools_gateway(api_stack, tiny_model_dir, tmp_path_factory):
    """A gateway serving the model with the hermes parser, beside the stack's own."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("tools-gateway") / "gateway.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway", "--serve", str(tiny_model_dir),
                             "--tool-call-parser", "hermes", "--port", str(port), "--gateway-id", "gateway-tools",
                             "--nats-url", api_stack.infra.nats_url, "--redis-url", api_stack.infra.redis_url,
                             "--log-format", "json"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **api_stack.infra.env_for("gateway")})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the tools gateway exited"
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the tools gateway did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def tools_client(api_stack, tools_gateway):
    return openai.OpenAI(base_url=tools_gateway + "/v1", api_key=api_stack.api_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def streamed(client, **kwargs):
    """A streamed chat reply put together as the SDK's users do: content, and tool calls by index."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def replied(client, stream: bool, **kwargs):
    """(content, [{id, name, arguments}], finish_reason), streamed or not."""
    if stream:
        return streamed(client, **kwargs)
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def rendered_tokens(tokenizer, messages, tools=None) -> int:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_tools_are_rendered_into_the_chat_template(client, tokenizer):
    """tool_choice none: plain content, from a prompt the template rendered with the tools and
    with an earlier call and its result."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0)
    # As Hugging Face templates read messages: null content empty, a call's arguments an object.
    as_template_reads = [{**m, "content": m["content"] or ""} for m in messages]
    as_template_reads[1]["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in messages[1]["tool_calls"]]
    expected = rendered_tokens(tokenizer, as_template_reads, TOOLS)
    assert out.usage.prompt_tokens == expected > rendered_tokens(tokenizer, as_template_reads) + 50
    choice = out.choices[0]
    assert isinstance(choice.message.content, str) and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_auto_needs_a_parser(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert err.value.body["param"] == "tool_choice" and "parser" in err.value.body["message"]


def test_bad_tools_are_refused_and_the_stack_serves_on(tools_client):
    with pytest.raises(openai.BadRequestError) as err:
        tools_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])
    assert err.value.body["param"] == "tools" and "JSON schema" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        tools_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=TOOLS,
                                             tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice" and "nope" in err.value.body["message"]
    out = tools_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=TOOLS,
                                               tool_choice="none")
    assert out.choices[0].message.content is not None


def test_an_unknown_parser_flag_stops_the_gateway_naming_it(api_stack, tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "services.gateway", "--serve", str(tiny_model_dir),
                           "--tool-call-parser", "mistral_v9", "--nats-url", api_stack.infra.nats_url,
                           "--redis-url", api_stack.infra.redis_url], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "mistral_v9" in proc.stderr and "hermes" in proc.stderr


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_hermes_reply_into_tool_calls(tools_client, stream):
    hermes = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Oslo|Lima)", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')
    content, calls, finish = replied(tools_client, stream, model=MODEL, messages=MESSAGES, tools=TOOLS,
                                     tool_choice="auto", max_tokens=120, seed=3, temperature=1.0,
                                     extra_body={"structured_outputs": {"regex": hermes}})
    assert content == "Checking."
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_arguments_that_validate(tools_client, stream):
    for seed in range(3):
        content, calls, finish = replied(
            tools_client, stream, model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120, seed=seed,
            temperature=1.0, tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert not content and len(calls) == 1 and calls[0]["name"] == "get_time"
        jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)
        assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_calls_that_validate(tools_client, stream):
    for seed, parallel in ((0, True), (1, True), (2, False)):
        content, calls, finish = replied(tools_client, stream, model=MODEL, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=parallel, max_tokens=200,
                                         seed=seed, temperature=1.0)
        assert not content and calls and finish == "tool_calls"
        assert len(calls) == 1 or parallel
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert len({c["id"] for c in calls}) == len(calls)
