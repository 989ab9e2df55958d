"""Tokenize and validate requests before they reach the engine loop (thread-safe)."""

from __future__ import annotations

from services.engine import logits_processors
from services.engine.model_config import ModelConfig
from services.engine import sampling_params
from services.engine.sampling_params import InvalidRequestError, SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, config: ModelConfig, max_model_len: int,
                 generation_defaults: dict[str, float | int] | None = None, structured=None):
        self.tokenizer = tokenizer
        self.structured = structured  # StructuredOutputs: compiles a request's grammar (cached)
        self.config = config
        self.max_model_len = max_model_len
        self.generation_defaults = generation_defaults or {}  # fill a request's unset fields

    def process(self, prompt: str | list[int], params: SamplingParams
                ) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text or None, prompt ids, the params with unset fields filled); raises
        InvalidRequestError naming the bad parameter."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            text, ids = prompt, self.tokenizer.encode(prompt)
            if any(t >= self.config.vocab_size for t in ids):  # a tokenizer larger than the embedding
                raise InvalidRequestError("the prompt tokenizes to ids outside the model's vocabulary", "prompt")
        elif isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.config.vocab_size:
                    raise InvalidRequestError(f"token id {t!r} outside the vocabulary [0, {self.config.vocab_size})",
                                              "prompt")
            text, ids = None, list(prompt)
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens leaves no room to generate: this model's maximum context "
                f"length is {self.max_model_len} tokens", "prompt")
        params = params.resolved(self.generation_defaults)
        sampling_params.check(params, self.config.vocab_size)
        if params.structured is not None:
            self.structured.compile(params.structured)  # InvalidRequestError if it cannot be
        return text, ids, params

    def logits_processors(self, params: SamplingParams) -> logits_processors.ResolvedProcessors | None:
        """A processed request's bad_words as token ids and the ids min_tokens masks, for its
        Sequence (the engine's; never on the parameters, which are the wire's)."""
        return logits_processors.resolve(params, self.tokenizer, self.config.eos_token_ids, self.config.vocab_size)
