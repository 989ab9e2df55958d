"""Request fields at the gateway (pure, no I/O): the table of every field each endpoint knows,
and the parsing of the logits-processor and text fields (vLLM's names) into SamplingParams.

The rule: a known field is honoured or refused with a 400 naming it, and so is any other field:
`refuse_unknown` answers it as OpenAI's API does ("Unrecognized request argument supplied"),
where vLLM would ignore it and log a warning. A client's typo, or a feature this gateway lacks,
fails loudly instead of changing nothing; the service counts the refused names in a metric.
"""

from __future__ import annotations

from typing import Any

from services.gateway import openai_api as oa  # its ApiError (a module import: openai_api imports this one)
from shared.sampling_ranges import LOGIT_BIAS

MAX_BIASED_TOKENS = 1024  # logit_bias entries per request (OpenAI allows 300)
MAX_BAD_WORDS = 256
MAX_ALLOWED_TOKEN_IDS = 2**20
TOKEN_ID_LIMIT = 2**31  # the model's vocabulary bounds them exactly once it is known (check_token_ids)

# Fields of both generation endpoints: sampling (OpenAI's and vLLM's), output, the other parts
# of issue 18 (structured outputs and vLLM's guided_decoding_backend / guided_whitespace_pattern,
# refused past what xgrammar does; n / best_of; prompt logprobs), and OpenAI's `user` (the end
# user, on the request's log lines and span).
_SHARED = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "n",
    "best_of", "stream", "stream_options", "logprobs", "logit_bias", "allowed_token_ids", "bad_words",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "echo", "user",
}
# Chat's own, besides messages and tools: OpenAI's `store`, `metadata`, `service_tier` and
# `modalities`, taken where they ask for what this server does (check_chat_options).
KNOWN_FIELDS: dict[str, frozenset[str]] = {
    "/v1/completions": frozenset(_SHARED | {"prompt", "suffix"}),
    "/v1/chat/completions": frozenset(_SHARED | {"messages", "top_logprobs", "tools", "tool_choice",
                                                 "parallel_tool_calls", "store", "metadata", "service_tier",
                                                 "modalities"}),
}
KNOWN_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
MAX_USER_LENGTH = 256
SERVICE_TIERS = (None, "auto", "default")  # one tier here: what a request may ask for


def unknown_fields(endpoint: str, body: dict) -> list[str]:
    """The body's fields `endpoint` does not know (stream_options' as `stream_options.NAME`)."""
    known = KNOWN_FIELDS[endpoint]
    unknown = [name for name in body if name not in known]
    options = body.get("stream_options")
    if isinstance(options, dict):
        unknown += [f"stream_options.{name}" for name in options if name not in KNOWN_STREAM_OPTIONS]
    return unknown


def refuse_unknown(endpoint: str, body: dict) -> None:
    """openai_api.UnrecognizedFields (a 400) if the body has a field `endpoint` does not know."""
    unknown = unknown_fields(endpoint, body)
    if unknown:
        raise oa.UnrecognizedFields(unknown)


def end_user(body: dict) -> str | None:
    """OpenAI's `user`: the end user's id, a string (the service puts it on the request's log
    lines and span, which is what it is for)."""
    user = body.get("user")
    if user is None:
        return None
    if not isinstance(user, str) or len(user) > MAX_USER_LENGTH:
        raise oa.bad(f"'user' must be a string of at most {MAX_USER_LENGTH} characters", "user")
    return user or None


def check_chat_options(body: dict) -> None:
    """OpenAI's chat options this server takes only where they ask for what it does: nothing
    stored (`store` false; `metadata`, kept only with stored completions, absent), one service
    tier, text out."""
    if body.get("store") not in (None, False):
        raise oa.bad("'store': this server does not store completions (only false is taken)", "store")
    if body.get("metadata") not in (None, {}):
        raise oa.bad("'metadata' is kept only with stored completions ('store'), which this server does not offer",
                     "metadata")
    if body.get("service_tier") not in SERVICE_TIERS:
        raise oa.bad("'service_tier' must be 'auto' or 'default': this server has one tier", "service_tier")
    if body.get("modalities") not in (None, ["text"]):
        raise oa.bad("'modalities': only [\"text\"] is supported", "modalities")


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < TOKEN_ID_LIMIT


def _logit_bias(body: dict) -> dict[int, float] | None:
    """{token id: bias}: JSON keys are strings of digits (OpenAI's form); biases in [-100, 100]."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_BIASED_TOKENS:
        raise oa.bad(f"'logit_bias' must be an object of at most {MAX_BIASED_TOKENS} token ids to biases",
                  "logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not _is_token_id(token):
            raise oa.bad(f"'logit_bias' keys must be token ids (strings of digits), got {key!r}", "logit_bias")
        problem = LOGIT_BIAS.problem(value)
        if problem:
            raise oa.bad(f"'logit_bias' values {problem} (token {key})", "logit_bias")
        out[token] = float(value)
    return out or None


def _allowed_token_ids(body: dict) -> list[int] | None:
    raw = body.get("allowed_token_ids")
    if raw is None:
        return None
    if (not isinstance(raw, list) or not raw or len(raw) > MAX_ALLOWED_TOKEN_IDS
            or not all(_is_token_id(t) for t in raw)):
        raise oa.bad("'allowed_token_ids' must be a non-empty list of token ids", "allowed_token_ids")
    return raw


def _bad_words(body: dict) -> list[str] | None:
    raw = body.get("bad_words")
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = [raw]
    if (not isinstance(raw, list) or len(raw) > MAX_BAD_WORDS
            or not all(isinstance(w, str) and w.strip() for w in raw)):
        raise oa.bad(f"'bad_words' must be a list of at most {MAX_BAD_WORDS} non-blank strings", "bad_words")
    return raw or None


def sampling_fields(body: dict) -> dict[str, Any]:
    """The SamplingParams fields of this module, parsed from a request body."""
    return {"logit_bias": _logit_bias(body), "allowed_token_ids": _allowed_token_ids(body),
            "bad_words": _bad_words(body), "min_tokens": oa.ranged(body, "min_tokens", 0),
            "skip_special_tokens": oa.flag(body, "skip_special_tokens", True),
            "include_stop_str_in_output": oa.flag(body, "include_stop_str_in_output", False)}


def continuous_usage_stats(options: dict) -> bool:
    value = options.get("continuous_usage_stats", False)
    if not isinstance(value, bool):
        raise oa.bad("'stream_options.continuous_usage_stats' must be a boolean", "stream_options")
    return value


def check_token_ids(spec, vocab_size: int) -> None:
    """The token ids of logit_bias and allowed_token_ids inside the model's vocabulary."""
    for name, ids in (("logit_bias", spec.logit_bias or ()), ("allowed_token_ids", spec.allowed_token_ids or ())):
        outside = next((t for t in ids if t >= vocab_size), None)
        if outside is not None:
            raise oa.bad(f"'{name}': token id {outside} is outside the vocabulary [0, {vocab_size})", name)
