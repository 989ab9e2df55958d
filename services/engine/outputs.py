"""What the engine hands back: per request, per step, and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort
    # Per generated token, when logprobs were asked: {token id: logprob}, the chosen token included.
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Speculative decoding: draft tokens proposed for the request and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def timings(self) -> dict[str, float]:
        """Seconds spent waiting in the queue, in prefill (to the first token), and decoding."""
        out: dict[str, float] = {}
        if self.first_scheduled_time is not None:
            out["queue"] = self.first_scheduled_time - self.arrival_time
            if self.first_token_time is not None:
                out["prefill"] = self.first_token_time - self.first_scheduled_time
                if self.finish_time is not None:
                    out["decode"] = self.finish_time - self.first_token_time
        return out


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # What this step added, for streaming consumers.
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    new_logprobs: list[tuple[int, float, dict[int, float]]] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    # Choices (n > 1): a streaming output is one choice's (outputs[0].index), ending that choice
    # when its finish_reason is set; `finished` is the whole request's, once every choice ended.
    choices_running: int = 0  # the request's choices not ended after this output
    num_completion_tokens: int = 0  # generated tokens of every choice (usage), on the finished output
    # When prompt_logprobs were asked: per prompt token after the first, its PromptLogprob
    # (services.engine.prompt_logprobs); complete from the first output on.
    prompt_logprobs: list | None = None
