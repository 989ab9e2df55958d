"""The engine's side of the sampling parameters.

`SamplingParams` itself is shared.protocol's: the wire's GenerateRequest.sampling, which the
worker hands the engine as decoded, and what `LLM.generate` takes. Here: the error the engine
refuses a request with, and the checks that need the model (`check`, run when a request is
added). What the engine derives from a request's parameters (bad words as token ids, the
ids min_tokens masks) is kept on its Sequence (logits_processors.resolve), never on the params.
"""

from __future__ import annotations

from shared import sampling_ranges
from shared.protocol import SamplingParams
from shared.sampling_ranges import BUILTIN_DEFAULTS

__all__ = ["BUILTIN_DEFAULTS", "InvalidRequestError", "SamplingParams", "check"]


class InvalidRequestError(ValueError):
    """A request the engine refuses at add time; the engine keeps serving the others."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check(params: SamplingParams, vocab_size: int) -> None:
    """Every rule for a request the engine adds, its parameters resolved: the ranges and the
    rules between fields (shared.sampling_ranges), and token ids inside the model's vocabulary.
    Raises InvalidRequestError naming the parameter. (`LLM` users' values were never decoded, so
    their types are checked here too.)"""
    def bad(param: str, message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{param}: {message}", param)

    for name in BUILTIN_DEFAULTS:
        if getattr(params, name) is None:
            raise bad(name, "unset (resolve the parameters first)")
    if params.logit_bias is not None and not isinstance(params.logit_bias, dict):
        raise bad("logit_bias", "must map token ids to biases")
    problem = sampling_ranges.check(params)
    if problem:
        raise bad(*problem)
    if not isinstance(params.stop, list) or any(not isinstance(s, str) or not s for s in params.stop):
        raise bad("stop", "stop strings must be non-empty strings")
    for t in params.stop_token_ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad("stop_token_ids", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
    _check_processors(params, vocab_size, bad)


def _check_processors(params: SamplingParams, vocab_size: int, bad) -> None:
    def token_id(t) -> bool:
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size

    for t in params.logit_bias or ():  # (a dict, its biases in range: checked in check)
        if not token_id(t):
            raise bad("logit_bias", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
    if params.allowed_token_ids is not None:
        if not isinstance(params.allowed_token_ids, list) or not params.allowed_token_ids:
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        for t in params.allowed_token_ids:
            if not token_id(t):
                raise bad("allowed_token_ids", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
    if params.bad_words is not None and (not isinstance(params.bad_words, list) or any(
            not isinstance(w, str) or not w.strip() for w in params.bad_words)):
        raise bad("bad_words", "must be a list of non-empty strings")
