"""Several choices in one response: `n`, `best_of`, and batches of completion prompts. Pure
functions, no I/O.

A request is one or more engine requests (legs): one per prompt of a batch, each asking the
engine for `n` choices (or `best_of`, of which the n with the highest cumulative logprob are
returned, as vLLM did). Choice k of prompt p is `index` p * n + k of the response, as OpenAI
and vLLM number them. The other parts of the response (text, logprobs, tool calls) are built per
choice by openai_api; this module numbers and merges them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import TokenChunk, Usage
from shared.sampling_ranges import RANGES

MAX_N_DEFAULT = 16  # choices per prompt (n, best_of) a gateway serves unless configured otherwise
MAX_BATCH_PROMPTS = 256  # prompts in one completions request


def _bad(message: str, param: str):
    from services.gateway.openai_api import bad

    return bad(message, param)


def _int(body: dict, name: str) -> int | None:
    """n or best_of: in the range of n (shared.sampling_ranges, as the wire and the engine check it)."""
    value = body.get(name)
    if value is None:
        return None
    problem = RANGES["n"].problem(value)
    if problem:
        raise _bad(f"'{name}' {problem}", name)
    return value


@dataclass
class Choices:
    n: int = 1  # choices returned per prompt
    best_of: int | None = None  # choices generated per prompt, of which the best n are returned

    @property
    def per_prompt(self) -> int:
        """Choices the engine generates for each prompt."""
        return self.best_of or self.n

    @property
    def selects(self) -> bool:
        return self.best_of is not None and self.best_of > self.n


def parse_choices(body: dict, stream: bool) -> Choices:
    n = _int(body, "n") or 1
    best_of = _int(body, "best_of")
    if best_of is not None and best_of < n:
        raise _bad(f"'best_of' must be >= n ({n}), got {best_of}", "best_of")
    choices = Choices(n, best_of)
    if choices.selects and stream:
        raise _bad("'best_of' greater than 'n' cannot be streamed: the best choices are known only at the end",
                   "best_of")
    return choices


def check_limit(choices: Choices, max_n: int) -> None:
    """The gateway's configured maximum of choices per prompt (a 400 naming the field)."""
    if choices.n > max_n:
        raise _bad(f"'n' must be <= {max_n} (this gateway's maximum), got {choices.n}", "n")
    if choices.best_of is not None and choices.best_of > max_n:
        raise _bad(f"'best_of' must be <= {max_n} (this gateway's maximum), got {choices.best_of}", "best_of")


def _token_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in prompt)


def parse_prompts(prompt) -> list[tuple[str | None, list[int] | None]]:
    """A completions `prompt`: a string, a list of token ids, or a batch (a list of strings or of
    token-id lists, mixed as the client likes) -> (text, ids) per prompt, in order."""
    if isinstance(prompt, str) or _token_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        items = prompt
    else:
        raise _bad("'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt")
    if len(items) > MAX_BATCH_PROMPTS:
        raise _bad(f"'prompt': at most {MAX_BATCH_PROMPTS} prompts in one request, got {len(items)}", "prompt")
    out: list[tuple[str | None, list[int] | None]] = []
    for i, item in enumerate(items):
        where = "'prompt'" if len(items) == 1 else f"'prompt'[{i}]"
        if isinstance(item, str):
            if not item:
                raise _bad(f"{where} must not be empty", "prompt")
            out.append((item, None))
        elif _token_ids(item):
            out.append((None, list(item)))
        else:
            raise _bad(f"{where} must be a non-empty string or a list of token ids", "prompt")
    return out


def cumulative_logprob(chunks: list[TokenChunk]) -> float:
    return sum(lp.logprob for c in chunks for lp in (c.logprobs or []))


def by_choice(chunks: list[TokenChunk]) -> dict[int, list[TokenChunk]]:
    """One leg's chunks grouped by choice, in choice order."""
    grouped: dict[int, list[TokenChunk]] = {}
    for chunk in chunks:
        grouped.setdefault(chunk.index, []).append(chunk)
    return dict(sorted(grouped.items()))


def best(grouped: dict[int, list[TokenChunk]], n: int) -> list[list[TokenChunk]]:
    """The n choices with the highest cumulative logprob, best first (vLLM's best_of)."""
    return sorted(grouped.values(), key=cumulative_logprob, reverse=True)[:n]


def response_index(prompt_no: int, choice: int, n: int) -> int:
    return prompt_no * n + choice


def merge_bodies(bodies: list[tuple[int, dict]]) -> dict:
    """One response from per-choice bodies (each with one choice): the first body's fields, every
    body's choice with its index, in index order."""
    first = dict(bodies[0][1])
    first["choices"] = [{**body["choices"][0], "index": index} for index, body in sorted(bodies, key=lambda b: b[0])]
    return first


def indexed(body: dict, index: int) -> dict:
    """A streamed chunk body (one choice) numbered as choice `index`."""
    body["choices"] = [{**body["choices"][0], "index": index}]
    return body


def total_usage(finals: list[TokenChunk]) -> Usage:
    """Usage over the legs' final chunks: each prompt once, every generated token."""
    usages = [f.usage for f in finals if f.usage is not None]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in usages))
