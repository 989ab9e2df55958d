"""The wire protocol: every NATS subject and message type, defined once.

Messages are msgspec Structs; payloads are msgpack maps carrying a schema version `v`. Decoding
(msgspec's, one cached typed decoder per message class) checks the version and every field's
presence and type, ignores unknown fields (so newer senders can add some), and raises
`ProtocolError` -- and nothing else -- on bad input. docs/protocol.md documents all of it for
other teams' services.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
from msgspec import field

from shared import sampling_ranges

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})  # (a reader of several would decode a union of each one's Structs)
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
PRIORITIES = ("critical", "standard", "sheddable")  # admission classes, highest first
# The sampling ranges (max_tokens, logprobs, ...): shared.sampling_ranges, read by gateway, wire and engine.

# ---- Subjects -------------------------------------------------------------------------------
PREFIX = "strata.v1"
GENERATE = f"{PREFIX}.generate"  # gateway/any caller -> schedulers (queue group SCHEDULER_QUEUE)
SCHEDULER_QUEUE = "strata-schedulers"
CANCEL = f"{PREFIX}.cancel"  # caller -> engines and schedulers (everyone checks ownership)
ENGINE_GENERATE_ALL = f"{PREFIX}.engine.*.generate"  # every engine_generate(replica) subject
ENGINE_KV_SNAPSHOT_ALL = f"{PREFIX}.engine.*.kv_snapshot"
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*"
KV_EVENTS_ALL = f"{PREFIX}.kv.>"
SCHEDULER_STATS_ALL = f"{PREFIX}.scheduler.*.stats"
LOGS_ALL = f"{PREFIX}.logs.>"  # every service's log lines (LogLine), also kept a while by JetStream
LOGS_STREAM = "STRATA_LOGS"  # the JetStream stream over LOGS_ALL, for `strata logs --since`
CONTROL_DEPLOYMENTS = f"{PREFIX}.control.deployments"  # control -> all: a deployment changed
CONTROL_KEYS = f"{PREFIX}.control.keys"  # control -> gateways: an API key was revoked (drop it from caches)
SCALER_STATUS = f"{PREFIX}.scaler.status"  # scaler -> control/dashboard: its decisions
CONTROL_POOLS = f"{PREFIX}.control.pools"  # control -> scaler: a capacity pool changed
SCALER_POOLS = f"{PREFIX}.scaler.pools"  # scaler -> control/dashboard: every pool's use, each tick
GATEWAY_STATS_ALL = f"{PREFIX}.gateway.*.stats"
LORA_ADAPTERS_ALL = f"{PREFIX}.lora.*"  # a model's registered LoRA adapters changed (LoraAdaptersChanged)


def _token(name: str) -> str:
    """A subject token must not contain separators or wildcards."""
    if not _is_token(name):
        raise ValueError(f"invalid subject token {name!r}")
    return name


def _is_token(name: str) -> bool:
    return bool(name) and not any(c in name for c in ".*> \t\r\n")


def _is_subject(subject: str) -> bool:
    """A concrete subject one can publish to: no wildcards, whitespace or empty tokens."""
    return (bool(subject) and not any(c in subject for c in "*> \t\r\n") and not subject.startswith(".")
            and not subject.endswith(".") and ".." not in subject)


def _check_tokens(message: Message, *names: str) -> None:
    """Ids that name subjects (replica, model): a message carrying a bad one is malformed, not a
    ValueError later in whoever builds a subject from it."""
    for name in names:
        if not _is_token(getattr(message, name)):
            raise ProtocolError(f"{type(message).__name__}: {name} {getattr(message, name)!r} is not a valid "
                                f"subject token")


def served_model_name(model_dir: str) -> str:
    """The default served name of a model directory: its name, made subject-safe."""
    import re
    from pathlib import Path

    return re.sub(r"[^A-Za-z0-9_-]", "_", Path(model_dir).resolve().name) or "model"


def engine_generate(replica_id: str) -> str:
    """scheduler -> one engine replica."""
    return f"{PREFIX}.engine.{_token(replica_id)}.generate"


def engine_kv_snapshot(replica_id: str) -> str:
    """request/reply: the full set of block hashes an engine holds (indexer resync)."""
    return f"{PREFIX}.engine.{_token(replica_id)}.kv_snapshot"


def heartbeat(replica_id: str) -> str:
    return f"{PREFIX}.heartbeat.{_token(replica_id)}"


def kv_events(model: str, replica_id: str) -> str:
    return f"{PREFIX}.kv.{_token(model)}.{_token(replica_id)}"


def scheduler_stats(scheduler_id: str) -> str:
    return f"{PREFIX}.scheduler.{_token(scheduler_id)}.stats"


def logs(service: str, instance: str) -> str:
    """One service instance's log lines; `logs(service, "*")` matches every instance."""
    return f"{PREFIX}.logs.{_token(service)}.{instance if instance == '*' else _token(instance)}"


def accepted(reply_to: str) -> str:
    """engine -> caller, beside the stream: a GenerateAck once an engine has taken the request
    (so a caller knows no scheduler holds it any more)."""
    return f"{reply_to}.accepted"


def lora_adapters(model: str) -> str:
    """gateway/control -> engines, gateways, schedulers: re-read the model's adapter registry."""
    return f"{PREFIX}.lora.{_token(model)}"


def gateway_stats(gateway_id: str) -> str:
    return f"{PREFIX}.gateway.{_token(gateway_id)}.stats"


# ---- Headers --------------------------------------------------------------------------------
HEADER_REQUEST_ID = "Strata-Request-Id"
HEADER_DEADLINE = "Strata-Deadline"  # unix seconds, as a decimal string
# traceparent / tracestate are the W3C names, injected by shared.bus.


# ---- Errors ---------------------------------------------------------------------------------
class ProtocolError(ValueError):
    """A payload that is not a valid message of the expected type and version."""


class InvalidRequest(ProtocolError):
    """A well-formed GenerateRequest with a value out of range: its caller can be told on its
    reply_to (which is valid), even when the message has no NATS reply subject."""

    def __init__(self, message: str, request_id: str, reply_to: str):
        super().__init__(message)
        self.request_id, self.reply_to = request_id, reply_to


class ErrorCode:
    BAD_REQUEST = "bad_request"  # the request itself is invalid; retrying will not help
    NOT_FOUND = "not_found"  # unknown model / deployment
    OVERLOADED = "overloaded"  # no capacity now; retry later
    UNAVAILABLE = "unavailable"  # replica draining / gone; the scheduler retries elsewhere
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


# ---- Messages -------------------------------------------------------------------------------
# Decoding is msgspec's (C): one cached msgspec.msgpack.Decoder per message class checks every
# field's presence and type as it parses. The rules the protocol had before msgspec are kept by
# deriving each field's *wire type* from its declared one, once per class (`_prepare`):
# - a float is finite (nan and inf are refused), and an int is accepted for it (msgspec's own rule);
# - a field with a default other than None also accepts nil, which means the default (absent and
#   nil are the same on the wire): `Message.__post_init__` puts the default back;
# - unknown fields are ignored (msgspec's default), so newer senders may add fields.
# A message sent on its own (`Envelope`) carries the schema version `v` as its msgspec tag: it is
# encoded first, and decoding refuses a missing or other version.
FINITE = msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)  # nan fails both bounds
FiniteFloat = Annotated[float, FINITE]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # a prompt's token ids (signed 64-bit)

M = TypeVar("M", bound="Message")
E = TypeVar("E", bound="Envelope")


class Message(msgspec.Struct, omit_defaults=True):
    """Base of every wire struct (a message, or a part of one). Fields at their default are not
    encoded (a reader fills the default in): a default is part of the schema."""

    def __post_init__(self) -> None:  # nil means the default (see above); runs on decode and on init
        defaults = _NONE_DEFAULTS.get(type(self))
        if defaults is None:
            defaults = _prepare(type(self))
        for name, default, factory in defaults:
            if getattr(self, name) is None:
                setattr(self, name, default() if factory else default)

    def to_dict(self) -> dict[str, Any]:
        """The message as builtins (nested messages as dicts), None fields left out; no `v`."""
        return {name: _to_builtins(value) for name in self.__struct_fields__
                if (value := getattr(self, name)) is not None}

    @classmethod
    def from_dict(cls: type[M], data: Any, where: str = "") -> M:
        """A message from builtins (as to_dict gives), checked as decode checks bytes."""
        try:
            msg = msgspec.convert(data, _wire_target(cls, tagged=False))
        except msgspec.ValidationError as exc:
            raise ProtocolError(_explain(where or cls.__name__, str(exc))) from None
        _check(msg)
        return msg

    def validate(self) -> None:
        """Cross-field checks after decoding; raise ProtocolError."""


def _version_tag(class_name: str) -> int:
    return SCHEMA_VERSION


class Envelope(Message, tag_field="v", tag=_version_tag):
    """A message sent on its own, a subject's payload: its map carries the schema version `v`."""


class _OtherVersion(Envelope, tag=0):
    """Decoding needs a union of two tagged structs for msgspec to require the tag; v = 0 is
    never a supported version, so this one only ever means "refused"."""


_NONE_DEFAULTS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}  # (field, default, is a factory)
_NESTED: dict[type, tuple[str, ...]] = {}  # fields holding messages that validate() something
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}
_ENCODER = msgspec.msgpack.Encoder()


def _prepare(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """Derive `cls`'s wire types (and its nested messages'), once, before any decoder reads them:
    msgspec reads a class's annotations when it first builds a decoder for it."""
    if cls in _NONE_DEFAULTS:
        return _NONE_DEFAULTS[cls]
    _NONE_DEFAULTS[cls] = ()  # (messages do not nest themselves; this only guards a loop)
    none_defaults, nested = [], []
    for f in msgspec.structs.fields(cls):
        wire = _wire_type(f.type)
        if f.default_factory is not msgspec.NODEFAULT:
            none_defaults.append((f.name, f.default_factory, True))
        elif f.default is not msgspec.NODEFAULT and f.default is not None:
            none_defaults.append((f.name, f.default, False))
        if none_defaults and none_defaults[-1][0] == f.name:
            wire = typing.Optional[wire]
        cls.__annotations__[f.name] = wire
        inner = _messages_in(f.type)
        for m in inner:
            _prepare(m)
        if any(_validates(m) for m in inner):
            nested.append(f.name)
    _NESTED[cls] = tuple(nested)
    _NONE_DEFAULTS[cls] = tuple(none_defaults)
    return _NONE_DEFAULTS[cls]


def _wire_type(hint: Any) -> Any:
    if hint is float:
        return FiniteFloat
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_wire_type(a) for a in args)]
    if origin is list:
        return list[_wire_type(args[0])]
    if origin is dict:
        return dict[_wire_type(args[0]), _wire_type(args[1])]
    return hint


def _messages_in(hint: Any) -> list[type]:
    if isinstance(hint, type) and issubclass(hint, Message):
        return [hint]
    return [m for a in typing.get_args(hint) for m in _messages_in(a)]


def _validates(cls: type) -> bool:
    return cls.validate is not Message.validate or bool(_NESTED.get(cls))


def _check(msg: Message) -> None:
    """validate() of every nested message that has one, then of `msg` itself."""
    for name in _NESTED[type(msg)]:
        value = getattr(msg, name)
        for part in (value.values() if isinstance(value, dict) else value if isinstance(value, list)
                     else (value,)):
            if isinstance(part, Message):
                _check(part)
    msg.validate()


def _wire_target(cls: type, tagged: bool) -> Any:
    _prepare(cls)
    return typing.Union[cls, _OtherVersion] if tagged else cls


def _decoder(cls: type[Envelope]) -> msgspec.msgpack.Decoder:
    decoder = _DECODERS.get(cls)
    if decoder is None:
        if not (isinstance(cls, type) and issubclass(cls, Envelope)):
            raise TypeError(f"{cls!r} is not a message sent on its own (an Envelope)")
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(_wire_target(cls, tagged=True))
    return decoder


def _to_builtins(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_to_builtins(v) for v in value] if value and isinstance(value[0], (Message, list, dict)) else list(value)
    if isinstance(value, dict):
        return {k: _to_builtins(v) for k, v in value.items()}
    return value


# msgspec's words for types and bounds, as this protocol's errors have always said them.
_KINDS = {"int": "an integer", "float": "a number", "object": "a map", "array": "a list", "null": "nil"}
_BOUNDS = {"float": "a finite number", "int": "an integer in [0, 2**63)"}  # FiniteFloat, TokenId
_ERROR = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_EXPECTED = re.compile(r"Expected `(?P<want>[^`]+)`(?:, got `(?P<got>[^`]+)`| (?P<bound>[<>]=? .+))?$", re.S)


def _explain(where: str, text: str) -> str:
    """msgspec's ValidationError as `Where.path: what` (a ProtocolError's message)."""
    m = _ERROR.match(text)
    what, path = m["what"], m["path"] or ""
    if path == ".v" or (not path and what == "Object missing required field `v`"):
        if what.startswith("Object missing"):
            return f"{where}: missing schema version 'v'"
        return (f"{where}: unsupported schema version ({what.replace('Invalid value', 'got')}) "
                f"(supported: {sorted(SUPPORTED_VERSIONS)})")
    where += path
    if what.startswith("Object missing required field `"):
        return f"{where}: missing required field '{what[31:-1]}'"
    expected = _EXPECTED.match(what)
    if expected is None:
        return f"{where}: {what}"
    kinds = [k for k in expected["want"].split(" | ") if k != "null"] or ["null"]
    if expected["bound"]:
        return f"{where}: expected {_BOUNDS.get(kinds[0], kinds[0])}, got {expected['bound']}"
    want = " or ".join(_KINDS.get(k, k) for k in kinds)
    return f"{where}: expected {want}, got {expected['got']}" if expected["got"] else f"{where}: expected {want}"


def encode(msg: Envelope) -> bytes:
    if not isinstance(msg, Envelope):
        raise TypeError(f"{type(msg).__name__} is not a message sent on its own (an Envelope)")
    return _ENCODER.encode(msg)


def decode(cls: type[E], data: bytes) -> E:
    """Decode `data` as a `cls` message; raises ProtocolError on anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{cls.__name__}: payload must be bytes")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"{cls.__name__}: payload of {size} bytes exceeds {MAX_PAYLOAD_BYTES}")
    decoder = _decoder(cls)
    try:
        msg = decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_explain(cls.__name__, str(exc))) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"{cls.__name__}: not valid msgpack ({exc})") from None
    except RecursionError:
        raise ProtocolError(f"{cls.__name__}: nested too deeply") from None
    if type(msg) is _OtherVersion:
        raise ProtocolError(f"{cls.__name__}: unsupported schema version 0 (supported: {sorted(SUPPORTED_VERSIONS)})")
    _check(msg)
    return msg


class StructuredSpec(Message):
    """Structured output (vLLM's `structured_outputs`): exactly one constraint, which the engine
    compiles to a grammar and enforces with a token mask at every step."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's / GBNF dialect)

    KINDS: ClassVar[tuple[str, ...]] = ("json", "json_object", "regex", "choice", "grammar")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        set_ = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ProtocolError(f"StructuredSpec: exactly one of {', '.join(self.KINDS)} must be set, got "
                                f"{set_ or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ProtocolError("StructuredSpec: choice must be a non-empty list of non-empty strings")


class SamplingParams(Message):
    """Sampling parameters: one class for the wire (GenerateRequest.sampling), the gateway that
    builds them and the engine (LLMEngine, `LLM.generate`) that runs them, as decoded. Ranges:
    shared.sampling_ranges (checked by GenerateRequest.validate, as by the gateway and the engine).
    Absent (None) temperature, top_p, top_k, min_p and repetition_penalty take the served model's
    generation_config.json defaults, else sampling_ranges.BUILTIN_DEFAULTS (`resolved`)."""

    max_tokens: int = 16
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0 = off (as is k >= the vocabulary)
    min_p: float | None = None
    seed: int | None = None  # same seed, same output, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # not in the output text; a str given to the constructor is [str]
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0 = only the chosen one)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    # Choices (n > 1): the engine forks the sequence after prefill into n, sharing the prompt's
    # KV blocks; each choice streams with its own TokenChunk.index. (best_of is the gateway's:
    # it asks for best_of choices and returns the n with the highest cumulative logprob.)
    n: int = 1
    # Structured outputs (issue 18): the output follows a JSON schema, regex, choice or grammar.
    structured: StructuredSpec | None = None
    # Prompt logprobs: top-n per prompt position (0 = only the prompt token's own), on the first
    # chunk; with them, max_tokens may be 0 (prefill only).
    prompt_logprobs: int | None = None
    # Fields (issue 18), vLLM's names: logits processors (services/engine/logits_processors.py),
    # and how the text is made.
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (as words: with and without a leading space)
    min_tokens: int = 0  # EOS and stop_token_ids masked (and stop strings not checked) until this many
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    MAX_LOGPROBS: ClassVar[int] = sampling_ranges.MAX_LOGPROBS
    MAX_N: ClassVar[int] = sampling_ranges.MAX_N  # bounds one request's sequences (a gateway's --max-n is lower)
    GREEDY_BELOW: ClassVar[float] = 1e-5  # smaller temperatures overflow logits / T: treated as greedy

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # SamplingParams(stop="\n"), as vLLM's takes it (never on the wire)
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        super().__post_init__()

    def resolved(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """A copy with every unset field filled: from `defaults` (the model's generation config),
        else the built-in default; self when none is unset."""
        unset = {name: (defaults or {}).get(name, value) for name, value in sampling_ranges.BUILTIN_DEFAULTS.items()
                 if getattr(self, name) is None}
        return msgspec.structs.replace(self, **unset) if unset else self

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class Resume(Message):
    """Marks a GenerateRequest as the continuation of a stream whose replica was lost: its
    prompt is the original prompt followed by the completion tokens already delivered."""

    request_id: str  # the original request
    generated: int  # the last `generated` prompt tokens are the completion delivered so far
    text_chars: int = 0  # characters of completion text already delivered
    replica_id: str | None = None  # the replica the stream left: routing avoids it
    attempt: int = 1  # 1 for the first migration, 2 for the second, ...


class GenerateRequest(Envelope):
    """A generation request; the token stream goes to `reply_to`."""

    request_id: str
    model: str
    reply_to: str
    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None  # each in [0, 2**63), checked as decoded
    sampling: SamplingParams = field(default_factory=SamplingParams)
    deadline: float | None = None  # unix seconds; the request is aborted after it
    tenant: str | None = None
    priority: str | None = None  # critical | standard | sheddable
    # Timestamps (unix seconds) stamped by each hop, for per-layer timings.
    timestamps: dict[str, float] = field(default_factory=dict)
    resume: Resume | None = None  # set on the continuation of a stream that lost its replica
    region: str | None = None  # where the caller is (the gateway's region): routing prefers replicas there
    # Set by whoever forwards it to an engine and waits for its GenerateAck: an engine that gets
    # it after this (unix seconds) refuses it, as its sender has given up and tries another.
    accept_by: float | None = None
    lora: str | None = None  # the LoRA adapter of `model` to run with (None: the base model)
    # A gateway's subject for its TokenChunkBatches: when set, the engine sends this request's
    # chunks there, in one TokenChunkBatch per step with the other requests bound for it, instead
    # of one message on reply_to per chunk. Callers that are not gateways leave it unset and get
    # per-request TokenChunks on reply_to. The GenerateAck still goes to accepted(reply_to).
    batch_to: str | None = None

    def validate(self) -> None:
        if not self.request_id:
            raise ProtocolError("GenerateRequest: request_id must not be empty")
        if not self.reply_to:
            raise ProtocolError("GenerateRequest: reply_to must not be empty")
        if self.prompt is None and self.prompt_token_ids is None:
            raise ProtocolError("GenerateRequest: one of 'prompt' or 'prompt_token_ids' is required")
        for name in ("reply_to", "batch_to"):
            subject = getattr(self, name)
            if subject is not None and not _is_subject(subject):
                raise ProtocolError(f"GenerateRequest: {name} {subject!r} is not a valid subject")
        if self.resume is not None:
            if self.prompt_token_ids is None:
                raise ProtocolError("GenerateRequest: a resumed request needs prompt_token_ids")
            if not 0 <= self.resume.generated < len(self.prompt_token_ids):
                raise ProtocolError("GenerateRequest: resume.generated must be in [0, len(prompt_token_ids))")
            if self.resume.text_chars < 0:
                raise ProtocolError("GenerateRequest: resume.text_chars must be >= 0")
        s = self.sampling
        for name in ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "n", "min_tokens"):
            value = getattr(s, name)
            if value is not None and not -2**63 <= value < 2**63:
                raise ProtocolError(f"GenerateRequest: sampling.{name} is outside the 64-bit range")
        problem = self._out_of_range()
        if problem:
            raise InvalidRequest(f"GenerateRequest: {problem}", self.request_id, self.reply_to)

    def _out_of_range(self) -> str | None:
        if self.priority is not None and self.priority not in PRIORITIES:
            return f"priority {self.priority!r} is not one of {', '.join(PRIORITIES)}"
        # The ranges the gateway and the engine check too (rules between fields: the engine's).
        problem = sampling_ranges.check(self.sampling, between_fields=False)
        return f"sampling.{problem[0]} {problem[1]}" if problem else None


class ErrorInfo(Message):
    code: str
    message: str
    retry_after_s: float | None = None  # overloaded: when trying again is likely to find room


class Usage(Message):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class SpecDecodeUsage(Message):
    """Speculative decoding for one request: draft tokens verified and how many were accepted."""

    draft_tokens: int
    accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class TokenLogprob(Message):
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-n alternatives: token id -> logprob
    rank: int | None = None  # of token_id in the vocabulary (1 = the most likely); prompt logprobs only


class TokenChunk(Envelope):
    """One message of a request's stream. The last one has `finish_reason` (or `error`)."""

    request_id: str
    seq: int  # 0, 1, 2, ... per request, so a reader can detect loss
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | abort | error
    error: ErrorInfo | None = None
    usage: Usage | None = None
    timings: dict[str, float] | None = None  # seconds per phase, on the final chunk
    # On the final chunk: the request's hop timestamps (unix seconds), the engine's included.
    timestamps: dict[str, float] | None = None
    logprobs: list[TokenLogprob] | None = None
    replica_id: str | None = None
    revision: int | None = None  # on the final chunk: the deployment revision that served it
    spec_decode: SpecDecodeUsage | None = None  # on the final chunk, when drafts were verified for it
    # Choices (SamplingParams.n > 1): which choice the chunk belongs to; chunks of different choices
    # interleave. Each choice ends in one chunk with its finish_reason; `choices_running` counts the
    # choices still running after it, so the request's final chunk is the one where it is 0 (and
    # carries the usage of all choices, the prompt counted once).
    index: int = 0
    choices_running: int = 0
    # On the first chunk, when sampling.prompt_logprobs was set: one per prompt token after the
    # first (the first has nothing before it), in order.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def is_final(self) -> bool:
        return self.error is not None or (self.finish_reason is not None and self.choices_running == 0)


class TokenChunkBatch(Envelope):
    """One engine step's chunks for one gateway (GenerateRequest.batch_to): every request of
    that gateway that has news this step, in step order. The gateway hands each chunk to its
    request's stream exactly as if it had come alone on the request's reply_to."""

    replica_id: str
    chunks: list[TokenChunk] = field(default_factory=list)


class Cancel(Envelope):
    """Abort a request. A cancel naming a replica is for that replica's run of the request only
    (a scheduler withdrawing a forward that timed out): the other replicas ignore it, so it can
    never refuse the retry on another one."""

    request_id: str
    tenant: str | None = None
    replica_id: str | None = None


class GenerateAck(Envelope):
    """An engine's answer on the NATS reply subject of a generate message (when it has one):
    accepted, or refused with an error. A refused request gets no chunk on `reply_to`: whoever
    asked (the scheduler) retries elsewhere or sends the caller the final error itself."""

    request_id: str
    replica_id: str
    accepted: bool
    error: ErrorInfo | None = None
    accepted_seq: int = 0  # engine: this request's place in its count of accepted requests


class ErrorReply(Envelope):
    """Reply to a malformed or refused message that had a reply subject."""

    error: ErrorInfo
    request_id: str | None = None


class Heartbeat(Envelope):
    replica_id: str
    model: str
    deployment: str
    state: str  # starting | ready | draining
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_rate: float = 0.0
    tokens_per_s: float = 0.0
    block_size: int = 16
    max_num_seqs: int = 64
    quantization: str = ""  # the weights as the replica runs them: none, int8, int4, fp8 ("": not said)
    kv_cache_dtype: str = ""  # auto (the model's dtype), int8, fp8
    accepted_total: int = 0  # requests accepted so far: running/waiting include every one up to here
    timestamp: float = 0.0
    revision: int = 0  # the deployment revision this replica serves (0: not managed by control)
    ttft_p90_s: float | None = None  # recent (last 30 s) time to first token at this engine
    itl_p50_s: float | None = None  # recent inter-token latency
    requests_finished: int = 0  # cumulative, by outcome: rates and error ratios per revision
    requests_failed: int = 0
    region: str = ""  # where the replica runs (routing prefers the request's region)
    pool: str = ""  # the capacity pool that started it ("" when not started by the scaler's pools)
    # Progress evidence: engine steps taken so far. Heartbeats come from a thread of their own
    # (they never wait on a step), so a replica whose steps stop while it holds work is stalled
    # even while it still beats; one whose steps advance slowly is only busy.
    steps_total: int = 0
    # LoRA (all empty / 0 when the engine serves no adapters): adapters in device slots, in the
    # host cache, and of running / waiting requests (vLLM's lora_requests_info); slots and rank.
    lora_resident: list[str] = field(default_factory=list)
    lora_cached: list[str] = field(default_factory=list)
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    max_loras: int = 0
    max_lora_rank: int = 0
    # The engine's effective limits (0: not said, by an older engine): a request's prompt plus
    # max_tokens must fit max_model_len, and its token ids must be below vocab_size. Gateways
    # check against these, not against the model's config.json (the engine's can be smaller).
    max_model_len: int = 0
    vocab_size: int = 0

    def validate(self) -> None:
        _check_tokens(self, "replica_id", "model")


class KvBlockStored(Message):
    block_hash: int
    parent_hash: int | None = None


class KvEventBatch(Envelope):
    """Blocks an engine stored and removed since its previous batch; `seq` reveals gaps."""

    replica_id: str
    model: str
    seq: int
    stored: list[KvBlockStored] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False  # the engine dropped its whole cache before these events
    epoch: str = ""  # changes when the engine restarts (its seq starts again at 1)

    def validate(self) -> None:
        _check_tokens(self, "replica_id", "model")


class KvSnapshot(Envelope):
    replica_id: str
    seq: int  # the event seq this snapshot is consistent with
    block_hashes: list[int] = field(default_factory=list)
    epoch: str = ""


class KvSnapshotRequest(Envelope):
    replica_id: str | None = None


class SchedulerStats(Envelope):
    """A scheduler's admission queues, every second: the scaler's main signal."""

    scheduler_id: str
    queue_depth: dict[str, int] = field(default_factory=dict)  # model -> requests waiting
    oldest_wait_s: dict[str, float] = field(default_factory=dict)  # model -> longest wait so far
    timestamp: float = 0.0
    http_url: str = ""  # its /metrics and /health


class LogLine(Envelope):
    """One structured log line of a service, as its JSON log line has it."""

    service: str  # gateway | scheduler | engine | ...
    instance: str  # gateway id, scheduler id, replica id
    level: str
    event: str
    timestamp: str  # ISO 8601, UTC
    fields: dict[str, Any] = field(default_factory=dict)  # the rest: request_id, replica_id, error, ...


class DeploymentChanged(Envelope):
    """A deployment was applied, re-weighted, promoted, rolled back or deleted. A hint: every
    reader re-reads the deployment from Redis (and resyncs periodically, so a lost hint heals)."""

    name: str
    action: str  # apply | canary | promote | rollback | delete
    generation: int  # increases with every change of this deployment
    stable: int = 0
    canary: int = 0  # 0: none
    canary_weight: int = 0  # percent of traffic to the canary revision


class LoraAdaptersChanged(Envelope):
    """A model's LoRA adapter registry (shared.adapters) changed: readers re-read it (and resync
    periodically, so a lost announcement heals)."""

    model: str
    action: str  # load | unload | spec
    name: str | None = None  # the adapter (load, unload)


class ScalerDecision(Envelope):
    """What the scaler wants for one deployment revision and why."""

    deployment: str
    revision: int
    desired: int
    ready: int
    starting: int
    reason: str = ""
    panic: bool = False
    timestamp: float = 0.0
    pools: dict[str, int] = field(default_factory=dict)  # capacity pool -> replicas held there
    short: int = 0  # of `desired`, replicas that no allowed pool can take (all full or refusing)
    placement: str = ""  # why the replicas are where they are ("spot 3 (full), ondemand 1", ...)


class LatencySample(Message):
    """One finished request as its client saw it, by the revision that served it: the input of
    control's canary analysis (services.control.canary)."""

    revision: int
    finished_at: float  # unix seconds
    ttft_s: float  # gateway arrival to the first token
    itl_s: float  # mean gap between the request's tokens after the first (0 with a single token)
    output_tokens: int


class RevisionOutcomes(Message):
    """Exact counts of one revision's requests in a report (samples may be thinned, these never are)."""

    requests: int = 0
    errors: int = 0  # ended in an error an engine of this revision sent


class GatewayStats(Envelope):
    """A gateway's requests since its previous report (every couple of seconds), with where
    their time went by layer: control's dashboard and `strata diagnose` read it."""

    gateway_id: str
    http_url: str = ""  # its /metrics and /health
    timestamp: float = 0.0
    interval_s: float = 0.0
    completed: dict[str, int] = field(default_factory=dict)  # model -> requests completed
    failed: dict[str, int] = field(default_factory=dict)  # model -> requests that ended in an error
    layer_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> layer -> sum
    # Per model, the requests of managed revisions (revision > 0): latency samples (at most
    # MAX_LATENCY_SAMPLES per model and report, an unbiased subsample beyond) and exact counts.
    samples: dict[str, list[LatencySample]] = field(default_factory=dict)
    outcomes: dict[str, dict[int, RevisionOutcomes]] = field(default_factory=dict)


MAX_LATENCY_SAMPLES = 2000


class KeyRevoked(Envelope):
    """An API key was revoked: every holder of a cached lookup drops it at once."""

    key_hash: str  # the key's SHA-256, hex


class PoolChanged(Envelope):
    """A capacity pool was applied, changed (capacity, cost, ...) or deleted. A hint, like
    DeploymentChanged: the scaler re-reads the pools from Redis (and resyncs periodically)."""

    name: str
    action: str  # apply | set | delete
    generation: int = 0


class PoolReport(Message):
    """One capacity pool as the scaler sees it."""

    name: str
    region: str = ""
    kind: str = ""  # kubernetes | local
    capacity: int = 0  # replicas the pool may hold (its spec)
    effective_capacity: int = 0  # what placement uses: less than capacity while it is backed off
    used: int = 0  # replicas alive there (ready + starting + draining), every deployment
    ready: int = 0
    starting: int = 0
    draining: int = 0
    cost_per_hour: float = 0.0  # per replica
    cold_start_s: float = 0.0  # measured (moving average), or the spec's estimate until measured
    cold_start_measured: bool = False
    refusals: int = 0  # since the scaler started
    backoff_s: float = 0.0  # seconds left of its back-off (0: taking replicas)
    last_refusal: str = ""  # why it last refused
    deployments: dict[str, int] = field(default_factory=dict)  # deployment -> replicas there


class PoolStatus(Envelope):
    """Every capacity pool's use, each scaler tick; `short` names the deployments that want more
    replicas than their allowed pools can hold."""

    scaler_id: str
    timestamp: float = 0.0
    pools: list[PoolReport] = field(default_factory=list)
    short: dict[str, int] = field(default_factory=dict)  # deployment -> replicas wanted and not placeable
    wanted: dict[str, int] = field(default_factory=dict)  # deployment -> replicas wanted


def _all_messages(cls: type = Message) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_all_messages(sub))]


for _cls in _all_messages():  # derive every wire type now, before anything decodes
    _prepare(_cls)
