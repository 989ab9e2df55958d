"""The ranges (and the built-in defaults) of the sampling parameters, defined once.

The gateway's request parsing (services/gateway/openai_api.py) and its OpenAPI schema, the wire's
GenerateRequest.validate (shared/protocol.py) and the engine's checks (services.engine.sampling_params.check,
services/engine/sampling_params.py) all read this table, so a value one of them accepts is never
refused by another. The semantics are vLLM's (SamplingParams._verify_args): temperature in
[0, 2], top_k -1 or 0 = off, repetition_penalty > 0; where Strata is narrower it says so
(seed >= 0; logprobs at most 20, no -1). Pure, no I/O.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; -1 (the whole vocabulary) is not offered
MAX_N = 256  # choices per request at the engine (a gateway's --max-n is its own, lower, policy)
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Range:
    """[lo, hi] (or (lo, hi] with lo_open; no upper bound with hi None), plus `off`: values
    outside it that mean "off". Integers are 64-bit; numbers are finite."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False
    off: tuple[int, ...] = ()

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool):
            return False
        if self.integer:
            if not isinstance(value, int) or not -2**63 <= value <= INT64_MAX:
                return False
            if value in self.off:
                return True
        elif not isinstance(value, (int, float)) or abs(value) > sys.float_info.max or not math.isfinite(value):
            return False  # (an int past the largest float too: math.isfinite would overflow on it)
        if value < self.lo or (self.lo_open and value == self.lo):
            return False
        return self.hi is None or value <= self.hi

    def describe(self) -> str:
        off = f"{' or '.join(map(str, self.off))} (off), or " if self.off else ""
        if self.hi is None:
            bound = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
            return f"{off}{bound} and < 2**63" if self.integer else f"{off}{bound}"
        return f"{off}in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}]"

    def problem(self, value: Any) -> str | None:
        """None if `value` is in range, else why not: 'must be in [0, 2], got 5'."""
        if self.contains(value):
            return None
        number = not isinstance(value, bool) and isinstance(value, int if self.integer else (int, float))
        kind = "" if number else "an integer " if self.integer else "a number "
        shown = repr(value)
        return f"must be {kind}{self.describe()}, got {shown if len(shown) <= 40 else shown[:37] + '...'}"

    def json_schema(self) -> dict:
        """The range as JSON Schema (the gateway's OpenAPI description)."""
        schema: dict[str, Any] = {"type": "integer" if self.integer else "number",
                                  "exclusiveMinimum" if self.lo_open else "minimum": self.lo}
        schema["maximum"] = self.hi if self.hi is not None else (INT64_MAX if self.integer else None)
        if schema["maximum"] is None:
            del schema["maximum"]
        if self.off:
            return {"oneOf": [*({"const": v} for v in self.off), schema]}
        return schema


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# What an unset (None) temperature, top_p, top_k, min_p and repetition_penalty means when the
# model's generation_config.json does not say (vLLM's defaults); the checkpoint's values fill in
# first (SamplingParams.resolved at the engine). Every value sent is checked against RANGES.
BUILTIN_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}

RANGES: dict[str, Range] = {
    "max_tokens": Range(1, INT32_MAX, integer=True),  # 0 too with prompt_logprobs (prefill only)
    "temperature": Range(0.0, 2.0),  # 0 = greedy
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(1, INT32_MAX, integer=True, off=(-1, 0)),  # k >= the vocabulary is off too
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, lo_open=True),
    "seed": Range(0, integer=True),  # vLLM takes negative seeds (-1 = none); Strata refuses them
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "n": Range(1, MAX_N, integer=True),
    "min_tokens": Range(0, INT32_MAX, integer=True),  # and at most max_tokens
}
LOGIT_BIAS = Range(-100.0, 100.0)  # each logit_bias value


def max_tokens_range(prefill_only: bool) -> Range:
    """max_tokens may be 0 (prefill only) when the request asks for prompt logprobs."""
    plain = RANGES["max_tokens"]
    return replace(plain, lo=0) if prefill_only else plain


def check(params: Any, between_fields: bool = True) -> tuple[str, str] | None:
    """The first sampling parameter of `params` (a shared.protocol.SamplingParams) out of range,
    as (name, why), or None. Unset (None) values are not checked; every logit_bias value must be
    in LOGIT_BIAS, and max_tokens may be 0 only with prompt_logprobs. `between_fields`: the
    engine's rules between fields too (min_tokens at most max_tokens; n 1 with max_tokens 0). The
    gateway and the wire leave those to the engine: a resumed stream's legs carry the max_tokens
    left, not the request's."""
    for name, range_ in RANGES.items():
        value = getattr(params, name)
        if name == "max_tokens":
            range_ = max_tokens_range(params.prompt_logprobs is not None)
        if value is not None and not range_.contains(value):
            why = range_.problem(value)
            if name == "max_tokens" and value == 0:
                why += " (0 only with prompt_logprobs)"
            return name, why
    for token, bias in (params.logit_bias or {}).items():
        if not LOGIT_BIAS.contains(bias):
            return "logit_bias", f"bias of token {token} {LOGIT_BIAS.problem(bias)}"
    if between_fields:
        if params.max_tokens == 0 and params.n > 1:
            return "n", "max_tokens 0 (prefill only) has no choices to fork: n must be 1"
        if params.min_tokens > params.max_tokens:
            return "min_tokens", f"must be at most max_tokens={params.max_tokens}, got {params.min_tokens}"
    return None
