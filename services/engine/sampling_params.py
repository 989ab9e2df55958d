"""Per-request sampling parameters, validated when a request is added."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses at add time; the engine keeps serving the others."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# What an unset sampling field means when the model's generation_config.json does not say
# (vLLM's defaults); the checkpoint's values fill in first (ModelConfig.generation_defaults).
BUILTIN_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass
class SamplingParams:
    """None for the fields of BUILTIN_DEFAULTS means unset: the engine fills them in from the
    model's generation config when a request is added (`resolved`), so an explicit value always
    wins and the engine only ever sees concrete values."""

    max_tokens: int = 16
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0 = off
    min_p: float | None = None
    seed: int | None = None  # same seed, same output, whatever else is in the batch
    stop: list[str] | str | None = None  # not included in the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0 = only the chosen one)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (services.engine.structured): shared.protocol.StructuredSpec, or None.
    structured: object = None
    # Choices (services.engine.choices): n sequences forked after prefill, sharing the prompt's KV.
    n: int = 1
    # Prompt logprobs (services.engine.prompt_logprobs): top-n per prompt position (0 = only the
    # prompt token's own); with them, max_tokens=0 means prefill only.
    prompt_logprobs: int | None = None
    # Logits processors (services/engine/logits_processors.py), with vLLM's names.
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (as words: with and without a leading space)
    min_tokens: int = 0  # EOS and stop_token_ids masked (and stop strings not checked) until this many
    # Filled when the request is added (logits_processors.resolve), read by the sampler.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    min_tokens_masked_ids: list[int] = field(default_factory=list, repr=False)

    MAX_LOGPROBS = 20
    MAX_N = 256  # bounds the sequences one request creates (the gateway's own limit, --max-n, is lower)
    MAX_LOGIT_BIAS = 100.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def resolved(self, defaults: dict[str, float | int] | None = None) -> "SamplingParams":
        """A copy with every unset field filled: from `defaults` (the generation config), else
        the built-in default."""
        unset = {name: (defaults or {}).get(name, value) for name, value in BUILTIN_DEFAULTS.items()
                 if getattr(self, name) is None}
        return dataclasses.replace(self, **unset) if unset else self

    GREEDY_BELOW = 1e-5  # smaller temperatures overflow logits / T: treated as greedy

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {message}", param)

        for name in BUILTIN_DEFAULTS:
            if getattr(self, name) is None:
                raise bad(name, "unset (resolve the parameters first)")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            raise bad("n", f"must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        least = 0 if self.prompt_logprobs is not None else 1  # 0: prefill only, for the prompt's logprobs
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise bad("max_tokens", f"must be an integer >= {least}, got {self.max_tokens!r}"
                      + ("" if least else " (0 only with prompt_logprobs)"))
        if self.max_tokens == 0 and self.n > 1:
            raise bad("n", "max_tokens 0 (prefill only) has no choices to fork: n must be 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k > vocab_size:
            raise bad("top_k", f"must be -1 (off) or an integer in [1, {vocab_size}], got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            raise bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise bad("stop_token_ids", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
        self._validate_processors(vocab_size, bad)

    def _validate_processors(self, vocab_size: int, bad) -> None:
        def token_id(t) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to biases")
            for t, b in self.logit_bias.items():
                if not token_id(t):
                    raise bad("logit_bias", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not (
                        -self.MAX_LOGIT_BIAS <= b <= self.MAX_LOGIT_BIAS):
                    raise bad("logit_bias", f"bias of token {t} must be in [-100, 100], got {b!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                if not token_id(t):
                    raise bad("allowed_token_ids", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of non-empty strings")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not (
                0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
