"""One request's state inside the engine: its tokens, its blocks, its progress and timings."""

from __future__ import annotations

import enum
import time

import numpy as np

from services.engine.sampling_params import SamplingParams
from services.engine.seen_tokens import SeenTokens
from shared.block_hash import ROOT_HASH


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None

        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # hash of each full block, memoized by the block manager
        self.num_registered_blocks = 0  # leading blocks of block_table already checked into the cache
        self.lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
        self.hash_root = ROOT_HASH  # parent hash of its first block: adapter_root_hash(lora_name)

        self._token_array = np.empty(0, dtype=np.int64)  # token_ids as an array, extended lazily
        self._token_array_len = 0
        self._seen: SeenTokens | None = None  # built on the first penalized step
        self.logprobs: list[dict] = []
        # Prompt logprobs (prompt_logprobs.PromptLogprob), for prompt tokens 1, 2, ... as computed.
        self.prompt_logprobs: list = []
        self.num_emitted_tokens = 0  # output tokens already handed out in a step output
        # Speculative decoding (services.engine.spec_decode): this step's draft tokens, verified
        # after the last token; the proposer's own state; and the request's draft counts.
        self.spec_token_ids: list[int] = []
        self.spec_state = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.processors = None  # logits_processors.ResolvedProcessors: bad_words / min_tokens ids, or None
        self.grammar = None  # structured outputs: its xgrammar GrammarMatcher (services.engine.structured)
        # Choices (services.engine.choices): which choice of its request it is, and the request's
        # ChoiceGroup when n > 1 (None: a request of one choice).
        self.index = 0
        self.group = None

        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def token_array(self) -> np.ndarray:
        """token_ids as an int64 array (a view valid until the next call); extended by what was
        appended since the last call, so a step costs its new tokens, not the whole sequence."""
        n = len(self.token_ids)  # token_ids only ever grow
        if n > len(self._token_array):
            grown = np.empty(max(2 * len(self._token_array), n, 64), dtype=np.int64)
            grown[:self._token_array_len] = self._token_array[:self._token_array_len]
            self._token_array = grown
        if n > self._token_array_len:
            self._token_array[self._token_array_len:n] = self.token_ids[self._token_array_len:n]
            self._token_array_len = n
        return self._token_array[:n]

    def seen_tokens(self) -> SeenTokens:
        """Its distinct ids and their output counts (what penalties read), brought up to date."""
        if self._seen is None:
            self._seen = SeenTokens()
        self._seen.update(self.token_array(), self.num_prompt_tokens)
        return self._seen

    def seen_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.seen_tokens().arrays()

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.value})")
