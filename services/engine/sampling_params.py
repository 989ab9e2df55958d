"""Per-request sampling parameters, validated when a request is added."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shared import sampling_ranges


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
    top_k: int | None = None  # -1 or 0 = off (as is k >= the vocabulary)
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

    # The ranges are shared.sampling_ranges' (the gateway and the wire check the same ones).
    MAX_LOGPROBS = sampling_ranges.MAX_LOGPROBS
    MAX_N = sampling_ranges.MAX_N  # bounds the sequences one request creates (a gateway's --max-n is lower)

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
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must map token ids to biases")
        problem = sampling_ranges.check(self)
        if problem:
            raise bad(*problem)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise bad("stop_token_ids", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
        self._validate_processors(vocab_size, bad)

    def _validate_processors(self, vocab_size: int, bad) -> None:
        def token_id(t) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size

        for t in self.logit_bias or ():  # (a dict, its biases in range: checked in validate)
            if not token_id(t):
                raise bad("logit_bias", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                if not token_id(t):
                    raise bad("allowed_token_ids", f"token id {t!r} outside the vocabulary [0, {vocab_size})")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of non-empty strings")
