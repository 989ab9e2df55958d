"""Per-request logits processors: logit_bias, allowed_token_ids, bad_words and min_tokens.

`resolve(params, tokenizer, eos_ids)` runs once when a request is added (LLMEngine.add_processed,
through InputProcessor.logits_processors): it tokenizes bad_words as vLLM does and fixes the ids
min_tokens masks, kept on the request's Sequence (`seq.processors`). `prepare(seqs, ...)` runs
on the host in the sampler's `prepare`, each step, only over the rows that have one of these
fields (None when no row has: nothing is built and nothing runs for the others); `apply` runs
in the sampler's `sample` and `probs` on the logits' device, in place on those rows' entries
only, before penalties and temperature / top-k / top-p.

The order is vLLM's: the allowed set first (everything else -inf), then the banned ids
(bad-word completions, and EOS / stop_token_ids while fewer than min_tokens were generated)
at -inf, then the biases added. A row's processors depend only on the row's own tokens
(`token_array`, `num_output_tokens`, `num_prompt_tokens`), so speculative decoding's verifier,
which prepares each verified position as the sequence would stand with the drafts before it
accepted, applies them at every position: verification stays exact, and requests using them
speculate like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Each bad word's token ids, as vLLM tokenizes them: the word without leading space, and
    again with one (the form it takes inside a text) when that tokenizes to as many tokens and
    starts with a different one."""
    out: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if bare:
            out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


@dataclass(frozen=True)
class ResolvedProcessors:
    """What `resolve` derives from a request's parameters for the sampler: kept on its Sequence
    (shared by its choices), never on the parameters, which are the wire's."""

    bad_words_token_ids: list[list[int]]  # each bad word's ids, as bad_words_token_ids tokenizes it
    min_tokens_masked_ids: list[int]  # masked while fewer than min_tokens were generated


def resolve(params: SamplingParams, tokenizer, eos_token_ids: list[int], vocab_size: int
            ) -> ResolvedProcessors | None:
    """params' bad words as token ids (a word whose ids fall outside the model's vocabulary
    cannot be generated anyway), and the ids min_tokens masks (the model's EOS ids unless
    ignore_eos, and stop_token_ids); None when it has neither field."""
    if not params.bad_words and params.min_tokens <= 0:
        return None
    words = [w for w in bad_words_token_ids(params.bad_words or [], tokenizer) if max(w) < vocab_size]
    masked = []
    if params.min_tokens > 0:
        eos = [] if params.ignore_eos else [t for t in eos_token_ids if 0 <= t < vocab_size]
        masked = sorted(set(eos) | set(params.stop_token_ids))
    return ResolvedProcessors(words, masked)


def needs_processing(seq) -> bool:
    p, resolved = seq.params, seq.processors
    return bool(p.logit_bias or p.allowed_token_ids or (resolved is not None and (
        resolved.bad_words_token_ids or (p.min_tokens > 0 and resolved.min_tokens_masked_ids))))


@dataclass
class LogitsProcessing:
    """One step's processors, as a few tensors on the logits' device."""

    allowed_rows: torch.Tensor | None = None  # [a] rows with allowed_token_ids
    allowed_ids: torch.Tensor | None = None  # [a, W] their ids, padded by repeating the row's first
    banned_rows: torch.Tensor | None = None  # [b] (row, id) pairs set to -inf
    banned_ids: torch.Tensor | None = None  # [b]
    bias_rows: torch.Tensor | None = None  # [c] (row, id, bias) added
    bias_ids: torch.Tensor | None = None  # [c]
    bias_values: torch.Tensor | None = None  # [c] fp32


def _banned_by_bad_words(seq, words: list[list[int]]) -> list[int]:
    """The ids that would complete one of `words` after seq's output so far: a one-token word
    always, a longer one when its other tokens were just generated."""
    output = seq.token_array()[seq.num_prompt_tokens:]
    banned = []
    for word in words:
        prefix = len(word) - 1
        if prefix == 0 or (len(output) >= prefix and np.array_equal(output[len(output) - prefix:], word[:-1])):
            banned.append(word[-1])
    return banned


def prepare(seqs: list, device: torch.device) -> LogitsProcessing | None:
    """The step's processors over the rows that need them; None when no row does."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s)]
    if not rows:
        return None
    proc = LogitsProcessing()
    allowed: list[tuple[int, list[int]]] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i in rows:
        seq = seqs[i]
        p, resolved = seq.params, seq.processors
        if p.allowed_token_ids:
            allowed.append((i, p.allowed_token_ids))
        banned = []
        if resolved is not None and resolved.bad_words_token_ids:
            banned += _banned_by_bad_words(seq, resolved.bad_words_token_ids)
        if resolved is not None and p.min_tokens > 0 and seq.num_output_tokens < p.min_tokens:
            banned += resolved.min_tokens_masked_ids
        banned_rows += [i] * len(banned)
        banned_ids += banned
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += list(p.logit_bias)
            bias_values += list(p.logit_bias.values())

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    if allowed:
        width = max(len(a) for _, a in allowed)
        table = np.empty((len(allowed), width), dtype=np.int64)
        for j, (_, a) in enumerate(allowed):
            table[j, :len(a)] = a
            table[j, len(a):] = a[0]
        proc.allowed_rows = ids([i for i, _ in allowed])
        proc.allowed_ids = torch.from_numpy(table).to(device, non_blocking=True)
    if banned_rows:
        proc.banned_rows, proc.banned_ids = ids(banned_rows), ids(banned_ids)
    if bias_rows:
        proc.bias_rows, proc.bias_ids = ids(bias_rows), ids(bias_ids)
        proc.bias_values = torch.tensor(bias_values, dtype=torch.float32).to(device, non_blocking=True)
    return proc


def apply(logits: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """The processors applied to `logits` ([rows, vocab], the model's dtype or fp32) in place;
    returns it. Only the processed rows' entries are touched (no copy of the batch): an allowed
    row is filled with -inf and its allowed values put back; a bias is added in fp32 and
    stored in the logits' dtype, the precision the logits themselves have."""
    if proc.allowed_rows is not None:
        rows = proc.allowed_rows.view(-1, 1).expand_as(proc.allowed_ids)
        kept = logits[rows, proc.allowed_ids]
        logits.index_fill_(0, proc.allowed_rows, NEG_INF)
        logits.index_put_((rows, proc.allowed_ids), kept)
    if proc.banned_rows is not None:
        logits.index_put_((proc.banned_rows, proc.banned_ids),
                          torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))
    if proc.bias_rows is not None:
        biased = logits[proc.bias_rows, proc.bias_ids].float() + proc.bias_values
        logits.index_put_((proc.bias_rows, proc.bias_ids), biased.to(logits.dtype))
    return logits
