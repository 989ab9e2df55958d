"""Tool calls parsed out of a model's text: pure, incremental, no I/O.

Each parser is a small state machine fed the completion text as it streams (`feed`) and told
when it ends (`finish`); it returns events: `Content` (text for the message's `content`) and
`CallDelta` (a piece of one tool call: its index, and its id and name on the first piece). A
non-streaming reply is the same parser fed the whole text at once (`assemble`), so streaming
and non-streaming always agree. Text a parser cannot read as a tool call is never dropped: it
comes back as content.

Parsers by the name a deployment gives (`tool_call_parser`, vLLM's names):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after
  optional content (Hermes, Qwen2.5, ...).
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;` (Llama 3.1+ JSON tool calling).
Two more serve `tool_choice` `required` and a named function, whose output structured
decoding has already constrained: `RequiredCalls` (a JSON array of {name, parameters}) and
`NamedCall` (the arguments object itself, streamed as it comes).
"""

from __future__ import annotations

import abc

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class Content:
    text: str


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # the first piece of a call carries its id and name
    name: str | None = None


Event = Content | CallDelta


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class UnknownToolParser(ValueError):
    def __init__(self, name: str):
        super().__init__(f"unknown tool call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
        self.name = name


class ToolParser(abc.ABC):
    """Base: keeps at most `max_calls` calls (1 when parallel_tool_calls is false; later ones
    are dropped, as that flag asks) and numbers them. Each format says how text is read."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.calls = 0

    @abc.abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events the next piece of streamed text makes (some text may be held back)."""

    @abc.abstractmethod
    def finish(self) -> list[Event]:
        """The events of whatever is held back once the reply has ended."""

    def _call(self, name: str, arguments: str) -> list[Event]:
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []
        self.calls += 1
        return [CallDelta(self.calls - 1, arguments, call_id(), name)]


def _decoded_call(obj, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
    return obj["name"], "{}"


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: the tag
    may be arriving in pieces)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.buffer = ""
        self.in_call = False
        self.space = ""  # whitespace held back: dropped between and after calls, content otherwise

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            if self.in_call:
                end = self.buffer.find(self.END)
                if end < 0:
                    return events
                events += self._close(self.buffer[:end], self.START + self.buffer[:end] + self.END)
                self.buffer, self.in_call = self.buffer[end + len(self.END):], False
                continue
            start = self.buffer.find(self.START)
            if start < 0:
                keep = _partial_prefix(self.buffer, self.START)
                events += self._content(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return events
            events += self._content(self.buffer[:start])
            self.buffer, self.in_call = self.buffer[start + len(self.START):], True

    def finish(self) -> list[Event]:
        if self.in_call:  # cut short (max_tokens): a call only if what came is complete JSON
            events = self._close(self.buffer, self.START + self.buffer)
        else:
            events = self._content(self.buffer)
        self.buffer = ""
        if not self.calls and self.space:
            events.append(Content(self.space))
        return events

    def _close(self, body: str, raw: str) -> list[Event]:
        try:
            call = _decoded_call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return self._content(raw)
        self.space = ""
        return self._call(*call)

    def _content(self, text: str) -> list[Event]:
        # Trailing whitespace waits for what follows, so a reply fed in pieces or whole reads the same.
        body = text.rstrip()
        if not body:
            self.space += text
            return []
        out, self.space = self.space + body, text[len(body):]
        return [Content(out)]


class _JsonSequence(ToolParser):
    """Calls written as JSON objects one after another, between separators; what cannot be read
    so comes back as content when the text ends."""

    OPEN = ""  # skipped once before the first object
    SEPARATORS = ""
    CLOSE = ""  # ends the sequence
    ARGUMENT_KEYS: tuple[str, ...] = ("parameters", "arguments")

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.buffer = ""
        self.opened = not self.OPEN
        self.closed = False
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while not self.closed:
            rest = self.buffer.lstrip()
            if not self.opened:
                if not rest.startswith(self.OPEN):
                    return events
                rest, self.opened = rest[len(self.OPEN):].lstrip(), True
            while rest and rest[0] in self.SEPARATORS:
                rest = rest[1:].lstrip()
            if self.CLOSE and rest.startswith(self.CLOSE):
                self.buffer, self.closed = rest[len(self.CLOSE):], True
                return events
            if not rest.startswith("{"):
                self.buffer = rest
                return events
            try:
                obj, end = self.decoder.raw_decode(rest)
            except ValueError:  # incomplete so far (or not JSON: finish says)
                self.buffer = rest
                return events
            call = _decoded_call(obj, self.ARGUMENT_KEYS)
            if call is None:
                self.buffer = rest
                return events
            events += self._call(*call)
            self.buffer = rest[end:]
        return events

    def finish(self) -> list[Event]:
        rest, self.buffer = self.buffer, ""
        return [Content(rest)] if rest.strip() else []


class Llama3JsonParser(_JsonSequence):
    """Only a reply that starts with a JSON object (or `<|python_tag|>`) is read as calls;
    anything else streams straight through as content."""

    PYTHON_TAG = "<|python_tag|>"
    SEPARATORS = ";"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.mode: str | None = None  # None: undecided; "calls" or "content"
        self.raw = ""  # everything, in case nothing in it is a call

    def feed(self, text: str) -> list[Event]:
        if self.mode == "content":
            return [Content(text)] if text else []
        self.raw += text
        if self.mode is None:
            head = self.raw.lstrip()
            if head.startswith(self.PYTHON_TAG):
                self.mode, text = "calls", head[len(self.PYTHON_TAG):]
                self.buffer = ""
            elif head.startswith("{"):
                self.mode, text = "calls", head
                self.buffer = ""
            elif not head or self.PYTHON_TAG.startswith(head):
                return []
            else:
                self.mode = "content"
                return [Content(self.raw)]
        return super().feed(text)

    def finish(self) -> list[Event]:
        if self.mode is None:
            return [Content(self.raw)] if self.raw else []
        if self.mode == "calls" and not self.calls:
            self.buffer = ""
            return [Content(self.raw)]
        return super().finish()


class RequiredCalls(_JsonSequence):
    """tool_choice "required": a JSON array of {"name", "parameters"} (the schema of
    services.gateway.tools.required_schema)."""

    OPEN, SEPARATORS, CLOSE = "[", ",", "]"


class NamedCall(ToolParser):
    """tool_choice naming a function: the text is that call's arguments, streamed as it comes."""

    def __init__(self, name: str):
        super().__init__(1)
        self.name = name

    def feed(self, text: str) -> list[Event]:
        if not self.calls:
            return self._call(self.name, text)
        return [CallDelta(0, text)] if text else []

    def finish(self) -> list[Event]:
        return [] if self.calls else self._call(self.name, "")


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_class(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise UnknownToolParser(name) from None


@dataclass
class Assembled:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def assemble(events: list[Event]) -> Assembled:
    """A whole reply's content and OpenAI-shaped tool_calls from its events."""
    text, calls = "", []
    for event in events:
        if isinstance(event, Content):
            text += event.text
        elif event.id is not None:
            calls.append({"id": event.id, "type": "function",
                          "function": {"name": event.name, "arguments": event.arguments}})
        else:
            calls[event.index]["function"]["arguments"] += event.arguments
    return Assembled(text if text or not calls else None, calls)


def delta(event: Event) -> dict:
    """The streaming `delta` of one event."""
    if isinstance(event, Content):
        return {"content": event.text}
    call: dict = {"index": event.index}
    if event.id is not None:
        call.update(id=event.id, type="function")
        call["function"] = {"name": event.name, "arguments": event.arguments}
    else:
        call["function"] = {"arguments": event.arguments}
    return {"tool_calls": [call]}
