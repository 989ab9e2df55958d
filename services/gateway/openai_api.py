"""OpenAI request validation and response shapes: pure functions, no I/O."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.gateway import prompt_logprobs, request_fields
from services.gateway.choices import Choices, parse_choices, parse_prompts
from services.gateway.prompt_logprobs import PromptOptions
from services.gateway.structured_outputs import parse_structured
from shared.layers import by_component, layer_timings
from shared.protocol import HEADER_DEADLINE, SamplingParams, TokenChunk, Usage
from shared.sampling_ranges import MAX_STOP_STRINGS, RANGES, Range, max_tokens_range

if TYPE_CHECKING:
    from services.gateway.tools import ToolRequest


class ApiError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class UnrecognizedFields(ApiError):
    """A 400 for fields the endpoint does not know (request_fields.refuse_unknown), as OpenAI's
    API answers them; `fields` names them all (the service counts them), `param` the first."""

    def __init__(self, fields: list[str]):
        super().__init__(400, f"Unrecognized request argument supplied: {', '.join(repr(f) for f in fields)}",
                         "invalid_request_error", fields[0], "unrecognized_request_argument")
        self.fields = fields


def error_response(exc: ApiError):
    """The aiohttp response of an ApiError, with Retry-After when it has one."""
    from aiohttp import web

    headers = {}
    if exc.retry_after is not None:
        headers["retry-after"] = str(max(int(exc.retry_after + 0.999), 1))
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# Status for each engine / scheduler error code that reaches the gateway. `cancelled` reaching a
# client that is still connected means someone else withdrew its request (499 is only for clients
# that left, and they are not answered at all): it may be retried.
ERROR_STATUS = {"bad_request": 400, "not_found": 404, "overloaded": 503, "unavailable": 503,
                "deadline_exceeded": 504, "cancelled": 503, "internal": 500}


def from_engine_error(code: str, message: str, retry_after: float | None = None) -> ApiError:
    status = ERROR_STATUS.get(code, 500)
    type_ = {400: "invalid_request_error", 404: "invalid_request_error", 503: "overloaded_error",
             504: "timeout_error"}.get(status, "server_error")
    return ApiError(status, message, type_, None, code,
                    retry_after=(retry_after or 1.0) if status == 503 else None)


HEADER_TIMEOUT = "Strata-Timeout"  # seconds from arrival
MAX_TIMEOUT_S = 86400.0


def request_deadline(headers, arrival: float, default_timeout: float) -> float:
    """The request's deadline (unix seconds): the gateway's default timeout, shortened by the
    headers Strata-Timeout (seconds) and Strata-Deadline (unix seconds), whichever is sooner."""
    deadline = arrival + default_timeout
    if HEADER_TIMEOUT in headers:
        try:
            timeout = float(headers[HEADER_TIMEOUT])
        except ValueError:
            timeout = math.nan
        if not 0 < timeout <= MAX_TIMEOUT_S:  # nan fails too
            raise bad(f"header {HEADER_TIMEOUT} must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}]")
        deadline = min(deadline, arrival + timeout)
    if HEADER_DEADLINE in headers:
        try:
            at = float(headers[HEADER_DEADLINE])
        except ValueError:
            at = math.nan
        if not math.isfinite(at) or at > arrival + MAX_TIMEOUT_S:
            raise bad(f"header {HEADER_DEADLINE} must be a time (unix seconds) within a day")
        if at <= arrival:
            raise ApiError(504, f"header {HEADER_DEADLINE} is already past", "timeout_error", None,
                           "deadline_exceeded")
        deadline = min(deadline, at)
    return deadline


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt_text: str | None  # completions with a text prompt, or the rendered chat template
    prompt_token_ids: list[int] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-n to return (None: no logprobs)
    extra: dict = field(default_factory=dict)
    tools: "ToolRequest | None" = None  # chat tool calling (services.gateway.tools)
    # Choices (services.gateway.choices): n and best_of; every prompt of a completions batch as
    # (text, ids) (prompt_text / prompt_token_ids are the first's).
    choices: Choices = field(default_factory=Choices)
    prompts: list[tuple[str | None, list[int] | None]] = field(default_factory=list)
    prompt: PromptOptions = field(default_factory=PromptOptions)  # echo, prompt_logprobs
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    user: str | None = None  # OpenAI's end-user id: on the request's log lines and span


def ranged(body: dict, name: str, default=None, range_: Range | None = None):
    """The body's number `name` in its range (shared.sampling_ranges.RANGES[name], which the wire
    and the engine check too), or `default` when absent or null; a 400 naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    range_ = range_ or RANGES[name]
    problem = range_.problem(value)
    if problem:
        raise bad(f"'{name}' {problem}", name)
    return value if range_.integer else float(value)


def flag(body: dict, name: str, default: bool) -> bool:
    """A boolean field: absent or null is `default`."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return stop


def _sampling(body: dict, max_tokens_default: int, logprobs: int | None) -> SamplingParams:
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    prefill_only = prompt_logprobs.min_max_tokens(body) == 0
    max_tokens = ranged(body, param, max_tokens_default, max_tokens_range(prefill_only))
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                                 for t in stop_ids):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    # Unset temperature, top_p, top_k, min_p and repetition_penalty stay unset: the engine fills
    # them in from the model's generation config.
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=ranged(body, "temperature"),
        top_p=ranged(body, "top_p"),
        top_k=ranged(body, "top_k"),
        min_p=ranged(body, "min_p"),
        seed=ranged(body, "seed"),
        stop=_stop(body),
        stop_token_ids=stop_ids,
        ignore_eos=flag(body, "ignore_eos", False),
        logprobs=logprobs,
        presence_penalty=ranged(body, "presence_penalty", 0.0),
        frequency_penalty=ranged(body, "frequency_penalty", 0.0),
        repetition_penalty=ranged(body, "repetition_penalty"),
        structured=parse_structured(body),
        **request_fields.sampling_fields(body),
    )


def _common(body: Any, endpoint: str) -> tuple[str, bool, bool, bool]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    request_fields.refuse_unknown(endpoint, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if options and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return model, stream, bool(options.get("include_usage", False)), request_fields.continuous_usage_stats(options)


def parse_completion(body: Any) -> ParsedRequest:
    model, stream, include_usage, continuous_usage = _common(body, "/v1/completions")
    prompts = parse_prompts(body.get("prompt"))
    text, ids = prompts[0]
    if body.get("suffix"):
        raise bad("'suffix' is not supported", "suffix")
    logprobs = ranged(body, "logprobs")
    parsed = ParsedRequest(False, model, text, ids, _sampling(body, 16, logprobs), stream, include_usage, logprobs,
                           choices=parse_choices(body, stream), prompts=prompts, continuous_usage=continuous_usage,
                           user=request_fields.end_user(body))
    parsed.prompt = prompt_logprobs.parse(body, False, logprobs, parsed.sampling, bad)
    return parsed


def parse_chat(body: Any) -> tuple[ParsedRequest, list[dict]]:
    from services.gateway.tools import message_tool_fields, parse_tools  # (tools.py imports this module)

    model, stream, include_usage, continuous_usage = _common(body, "/v1/chat/completions")
    request_fields.check_chat_options(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}] must have a role of system, developer, user, assistant or tool", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content,
                      **message_tool_fields(m, i)})
    logprobs = None
    if body.get("logprobs"):
        logprobs = ranged(body, "top_logprobs", 0, RANGES["logprobs"])
    elif body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    parsed = ParsedRequest(True, model, None, None, _sampling(body, 16, logprobs), stream, include_usage, logprobs,
                           choices=parse_choices(body, stream), continuous_usage=continuous_usage,
                           user=request_fields.end_user(body))
    parsed.tools = parse_tools(body, parsed.sampling)
    parsed.prompt = prompt_logprobs.parse(body, True, logprobs, parsed.sampling, bad)
    # OpenAI's chat default is "as many as fit": the service sets it once the prompt is tokenized.
    parsed.extra["max_tokens_unset"] = "max_tokens" not in body and "max_completion_tokens" not in body
    return parsed, clean


# ---- responses ---------------------------------------------------------------------------------
def usage_dict(chunk: TokenChunk) -> dict:
    u = chunk.usage or Usage(prompt_tokens=0, completion_tokens=0)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage of a stream so far (stream_options.continuous_usage_stats)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_chat(chunks: list[TokenChunk], decode, top_n: int) -> dict | None:
    entries = [lp for c in chunks for lp in (c.logprobs or [])]
    if not entries:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for e in entries:
        top = sorted(e.top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in top]})
    return {"content": content}


def completion_body(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                    logprobs: dict | None, usage: dict | None, chunk: bool, vllm_prompt_logprobs: list | None = None
                    ) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if vllm_prompt_logprobs is not None:  # vLLM's prompt_logprobs, asked for
        body["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def chat_body(rid: str, model: str, created: int, text: str, finish_reason: str | None,
              logprobs: dict | None, usage: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}


def strata_extension(final: TokenChunk, done: float) -> dict:
    """Where the request's time went (seconds per layer, shared.layers, and `e2e`), the same
    split by component (runtime / infrastructure), and which replica (and revision) served it."""
    timings = layer_timings({**(final.timestamps or {}), "gateway_done": done})
    extension = {"replica_id": final.replica_id, "revision": final.revision,
                 "timings": {k: round(v, 6) for k, v in timings.items()},
                 "components": {k: round(v, 6) for k, v in by_component(timings).items()}}
    if final.spec_decode is not None:  # speculative decoding: the request's acceptance
        spec = final.spec_decode
        extension["spec_decode"] = {"draft_tokens": spec.draft_tokens, "accepted_tokens": spec.accepted_tokens,
                                    "acceptance_rate": round(spec.acceptance_rate, 4)}
    return extension


def now() -> int:
    return int(time.time())
