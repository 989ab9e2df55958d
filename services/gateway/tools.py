"""Tool calling in chat requests (issue 18): `tools`, `tool_choice`, `parallel_tool_calls`, and
the messages that carry calls and their results. Pure: no I/O.

`tool_choice` `required` and a named function are enforced by structured output (a JSON schema
built from the functions' parameters, on `SamplingParams.structured`); `auto` is read from the
model's text by the deployment's parser (services.gateway.tool_parsers); `none` leaves the
reply as plain content. Tools are rendered by the model's chat template in every case, as vLLM
does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from services.gateway.openai_api import bad
from services.gateway.tool_parsers import NamedCall, RequiredCalls, ToolParser, assemble, delta, parser_class
from shared.protocol import SamplingParams, StructuredSpec

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
ANY_OBJECT = {"type": "object"}


@dataclass
class ToolRequest:
    tools: list[dict]  # as the chat template gets them: [{"type": "function", "function": {...}}]
    choice: str  # none | auto | required | function (then `function` names it)
    function: str | None = None
    parallel: bool = True
    parser: str | None = None  # auto: the deployment's tool_call_parser (bind_parser)

    def parser_for_reply(self) -> ToolParser | None:
        """A fresh parser for one reply (None: plain content)."""
        max_calls = None if self.parallel else 1
        if self.choice == "function":
            return NamedCall(self.function)
        if self.choice == "required":
            return RequiredCalls(max_calls)
        if self.choice == "auto":
            return parser_class(self.parser)(max_calls)
        return None


def parse_tools(body: dict, sampling: SamplingParams) -> ToolRequest | None:
    """The request's tools (None if it has none); `required` and named choice constrain
    `sampling` with their schema."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise bad("'tools' must be a list of functions", "tools")
        if choice not in (None, "none"):
            raise bad("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise bad("'tools' must be a list of at most 128 functions", "tools")
    functions: dict[str, list[dict]] = {}  # name -> parameters (a name given twice: either definition)
    clean = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'", "tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            try:
                Draft202012Validator.check_schema(parameters)
            except SchemaError as exc:
                raise bad(f"tools[{i}].function.parameters is not a valid JSON schema: {exc.message}",
                          "tools") from None
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"tools[{i}].function.strict must be a boolean", "tools")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad(f"tools[{i}].function has unknown fields: {', '.join(sorted(unknown))}", "tools")
        functions.setdefault(name, []).append(parameters or ANY_OBJECT)
        clean.append({"type": "function", "function": {k: function[k] for k in ("name", "description", "parameters")
                                                       if function.get(k) is not None}})
    request = ToolRequest(clean, "auto", parallel=parallel)
    if choice is None or choice in ("none", "auto", "required"):
        request.choice = choice or "auto"
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        request.choice, request.function = "function", choice["function"]["name"]
        if request.function not in functions:
            raise bad(f"tool_choice names the function {request.function[:64]!r}, which is not in 'tools'",
                      "tool_choice")
    else:
        raise bad("'tool_choice' must be 'none', 'auto', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if request.choice in ("required", "function"):
        if sampling.structured is not None:
            raise bad(f"tool_choice {request.choice!r} is enforced by structured output: it cannot be combined "
                      "with response_format or structured_outputs", "tool_choice")
        schema = (_one_of(functions[request.function]) if request.choice == "function"
                  else required_schema(functions, parallel))
        sampling.structured = StructuredSpec(json=json.dumps(schema))
    return request


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def required_schema(functions: dict[str, list[dict]], parallel: bool) -> dict:
    """tool_choice "required": an array of calls, each one of the functions with its parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, definitions in functions.items() for parameters in definitions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": _one_of(calls)}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def bind_parser(request: ToolRequest | None, parser: str | None) -> None:
    """`auto` reads calls with the served model's tool_call_parser, which it must have."""
    if request is not None and request.choice == "auto":
        if not parser:
            raise bad("tool_choice 'auto' needs a tool call parser, and this model has none (the gateway's "
                      "--tool-call-parser, or the deployment's tool_call_parser)", "tool_choice")
        request.parser = parser


def check_template_renders_tools(request: ToolRequest | None, chat_template: str | None) -> None:
    """A chat template that never reads `tools` would drop them silently."""
    if request is not None and "tools" not in (chat_template or ""):
        raise bad("this model's chat template does not render tools", "tools")


def message_tool_fields(message: dict, i: int) -> dict:
    """The tool fields of one chat message, as chat templates read them: an assistant's
    `tool_calls` (arguments decoded to objects) and a tool result's `tool_call_id`."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls must be a list, on an assistant message", "messages")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                    or not isinstance(function.get("arguments"), str)):
                raise bad(f"messages[{i}].tool_calls[{j}] must have function.name and function.arguments "
                          "(a JSON string)", "messages")
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                raise bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON", "messages") from None
            out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                      "function": {"name": function["name"], "arguments": arguments}})
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if message.get("role") != "tool" or not isinstance(call_id, str):
            raise bad(f"messages[{i}].tool_call_id must be a string, on a tool message", "messages")
        out["tool_call_id"] = call_id
    return out


def finish_reason(reason: str | None, tool_calls: bool) -> str | None:
    """A reply that ended by itself with calls in it ends with "tool_calls"."""
    return "tool_calls" if tool_calls and reason == "stop" else reason


def reply_choice(choice: dict, request: ToolRequest, text: str) -> None:
    """A whole chat reply's choice with its tool calls read out of `text`."""
    parser = request.parser_for_reply()
    if parser is None:
        return
    reply = assemble(parser.feed(text) + parser.finish())
    choice["message"]["content"] = reply.content
    if reply.tool_calls:
        choice["message"]["tool_calls"] = reply.tool_calls
    choice["finish_reason"] = finish_reason(choice["finish_reason"], bool(reply.tool_calls))


def stream_deltas(parser: ToolParser, text: str, final: bool, reason: str | None,
                  logprobs: bool) -> tuple[list[dict], str | None]:
    """The deltas one streamed piece of text makes (content and tool call pieces), and its
    finish reason. A piece the parser holds back makes none, unless it ends the stream or has
    logprobs to carry (then one empty delta)."""
    events = parser.feed(text) + (parser.finish() if final else [])
    deltas = [delta(e) for e in events] or ([{}] if final or logprobs else [])
    return deltas, finish_reason(reason, parser.calls > 0) if final else None
