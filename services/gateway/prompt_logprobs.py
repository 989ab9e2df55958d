"""Completions `echo`, prompt logprobs and `text_offset`: request parsing and response shapes
(pure: no I/O).

- `echo` (completions only; chat refuses it): the prompt's text comes first in the choice's
  text, and with `logprobs` the logprobs cover the prompt's tokens then the completion's, the
  first prompt token's logprob null (nothing comes before it), as OpenAI and vLLM return them.
  With `echo`, `max_tokens` may be 0: the prompt is scored and nothing generated.
- vLLM's `prompt_logprobs: n`: a top-level `prompt_logprobs` list in each completion choice (in
  the response, for chat): None for the first prompt token, then {token id: {logprob, rank,
  decoded_token}} with the prompt token and the top n.
- `text_offset`: each token's character offset in the choice's returned text; a token's text is
  what it decodes to on its own with special tokens skipped (a BOS token takes no characters).

Both become one wire field, `SamplingParams.prompt_logprobs` (the larger n of the two asked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from shared.protocol import SamplingParams, TokenChunk, TokenLogprob
from shared.sampling_ranges import RANGES


@dataclass
class PromptOptions:
    """What a request asked of its prompt."""

    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's field (its top-n), None if not asked
    # The request's: a completion token's text_offset counts what it adds to the text, special
    # tokens too when they are kept (the echoed prompt's text always skips them).
    skip_special_tokens: bool = True


def min_max_tokens(body: dict) -> int:
    """The least max_tokens a request may ask for: 0 when it only scores its prompt."""
    return 0 if body.get("echo") is True or body.get("prompt_logprobs") is not None else 1


def parse(body: dict, chat: bool, logprobs: int | None, sampling: SamplingParams, bad) -> PromptOptions:
    """The request's prompt options; sets `sampling.prompt_logprobs` for what they need. `bad`
    builds the 400 (openai_api.bad). max_tokens 0 got past _sampling only with echo or
    prompt_logprobs (min_max_tokens)."""
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise bad("'echo' must be a boolean", "echo")
    if echo and chat:
        raise bad("'echo' is only supported by /v1/completions, not by chat completions", "echo")
    n = body.get("prompt_logprobs")
    problem = None if n is None else RANGES["prompt_logprobs"].problem(n)
    if problem:
        raise bad(f"'prompt_logprobs' {problem}", "prompt_logprobs")
    wanted = [k for k in (n, logprobs if echo else None) if k is not None]
    if echo and sampling.max_tokens == 0 and not wanted:
        wanted = [0]  # prefill only: the engine runs it for its prompt logprobs, which nobody shows
    if wanted:
        sampling.prompt_logprobs = max(wanted)
    return PromptOptions(echo, n, sampling.skip_special_tokens)


def _top(e: TokenLogprob, n: int, decode: Callable[[int], str]) -> dict[str, float]:
    """The top n (in the engine's order, most likely first) and the token itself."""
    top = {decode(t): v for t, v in list(e.top.items())[:n]}
    top[decode(e.token_id)] = e.logprob
    return top


class TokenTexts(Protocol):
    """The served model's texts of tokens (ServedModel)."""

    def decode_token(self, token_id: int) -> str: ...  # as shown in `tokens`

    def visible_text(self, token_id: int) -> str: ...  # what it adds to a choice's text, special tokens skipped

    def decode_text(self, ids: list[int]) -> str: ...  # a token-id prompt, echoed


class CompletionLogprobs:
    """The `logprobs` of one completion choice, chunk by chunk: tokens, token_logprobs,
    top_logprobs and text_offset, the offsets running on across chunks."""

    def __init__(self, texts: TokenTexts, top_n: int, skip_special_tokens: bool = True):
        self.texts, self.top_n = texts, top_n
        # What a completion token adds to the text (the prompt's always skip special tokens).
        self.completion_text = texts.visible_text if skip_special_tokens else texts.decode_token
        self.offset = 0

    def take(self, chunks: list[TokenChunk], prompt: tuple[list[int], list[TokenLogprob]] | None = None
             ) -> dict | None:
        """The logprobs of these chunks; with `prompt` (echo: its ids and logprobs), the prompt's first."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        decode = self.texts.decode_token
        if prompt is not None:
            ids, entries = prompt
            self._add(out, ids[0], None, None, self.texts.visible_text)
            for token_id, e in zip(ids[1:], entries):
                self._add(out, token_id, e.logprob, _top(e, self.top_n, decode), self.texts.visible_text)
        for e in (lp for c in chunks for lp in (c.logprobs or [])):
            self._add(out, e.token_id, e.logprob, {decode(t): v for t, v in e.top.items()}, self.completion_text)
        return out if out["tokens"] else None

    def _add(self, out: dict, token_id: int, logprob: float | None, top: dict | None,
             text: Callable[[int], str]) -> None:
        out["tokens"].append(self.texts.decode_token(token_id))
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(text(token_id))


class PromptParts:
    """What the prompts add to a response's choices, by prompt of a batch (`prompt_no`) and by
    choice (`index`, the response's): the echoed text, logprobs from the prompt's on, and vLLM's
    prompt_logprobs, each with the choice's first chunk. `prompts`: (text or None, ids) each."""

    def __init__(self, options: PromptOptions, top_n: int | None, prompts: list[tuple[str | None, list[int]]],
                 texts: TokenTexts):
        self.options, self.prompts, self.texts = options, prompts, texts
        self.top_n = top_n  # completions' `logprobs` (None: not asked)
        self.entries: dict[int, list[TokenLogprob]] = {}  # the prompt's logprobs, from its leg's first chunk
        self.logprobs: dict[int, CompletionLogprobs] = {}
        self.started: set[int] = set()

    def note(self, prompt_no: int, chunk: TokenChunk) -> None:
        if chunk.prompt_logprobs is not None:
            self.entries[prompt_no] = chunk.prompt_logprobs

    def completion(self, prompt_no: int, index: int, chunks: list[TokenChunk]) -> tuple[str, dict | None, list | None]:
        """(text, logprobs, vLLM's prompt_logprobs) of choice `index` over `chunks`: the whole
        choice, or its next streamed chunk."""
        for chunk in chunks:
            self.note(prompt_no, chunk)
        first = index not in self.started
        self.started.add(index)
        text, ids = self.prompts[prompt_no]
        entries = self.entries.get(prompt_no, [])
        echo = self.options.echo and first
        prefix = (text if text is not None else self.texts.decode_text(ids)) if echo else ""
        logprobs = None
        if self.top_n is not None:
            state = self.logprobs.setdefault(index, CompletionLogprobs(self.texts, self.top_n,
                                                                       self.options.skip_special_tokens))
            logprobs = state.take(chunks, (ids, entries) if echo else None)
        return prefix + "".join(c.text for c in chunks), logprobs, self.vllm(prompt_no) if first else None

    def chat_fields(self, prompt_no: int, chunk: TokenChunk) -> dict:
        """vLLM's `prompt_logprobs` of a chat response (top-level), with the chunk that brings them."""
        if self.options.prompt_logprobs is None or chunk.prompt_logprobs is None:
            return {}
        self.note(prompt_no, chunk)
        return {"prompt_logprobs": self.vllm(prompt_no)}

    def vllm(self, prompt_no: int) -> list | None:
        if self.options.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.prompts[prompt_no][1], self.entries.get(prompt_no, []),
                                    self.options.prompt_logprobs, self.texts.decode_token)


def vllm_prompt_logprobs(prompt_ids: list[int], entries: list[TokenLogprob], n: int,
                         decode: Callable[[int], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {id: {logprob, rank,
    decoded_token}} for the prompt token and the top n (ranks 1..n in order)."""
    out: list[dict | None] = [None]
    for token_id, e in zip(prompt_ids[1:], entries):
        item = {str(t): {"logprob": v, "rank": r, "decoded_token": decode(t)}
                for r, (t, v) in enumerate(list(e.top.items())[:n], start=1)}
        item.setdefault(str(token_id), {"logprob": e.logprob, "rank": e.rank, "decoded_token": decode(token_id)})
        out.append(item)
    return out
