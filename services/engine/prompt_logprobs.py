"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt token after the first, its
logprob under the model given the tokens before it, and the top-n alternatives at that position.

The runner computes logits only for the rows it samples; a request that asks for prompt logprobs
also gets the rows of its prompt positions, chunk by chunk as its prefill runs (chunked prefill
needs nothing more). Positions served from the prefix cache are never computed, so such requests
skip prefix-cache hits (BlockManager.match_prefix), as vLLM does. A sequence recomputed after a
preemption only computes the positions it has no entry for yet.

Logprobs are the fp32 log-softmax of the raw logits (before temperature, penalties or any
processor), as vLLM returns them. On CPU one C pass a row (kernels.cpu.logprob_rows) reads the
logits in the model's dtype for the log-sum-exp, the target's logprob and rank, and the top-n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu as cpu_kernels
from services.engine.sequence import Sequence


@dataclass
class PromptLogprob:
    """Prompt token `token_id` (at position p >= 1): its logprob given tokens [0, p), its rank in
    the vocabulary (1 = the most likely), and the top-n {token id: logprob} at that position."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclass
class PromptLogprobRows:
    """One sequence's rows of a step's hidden states whose logits give prompt logprobs."""

    seq: Sequence
    first_row: int  # row of the batch's flattened tokens at position `first_position`
    first_position: int  # predicts prompt token first_position + 1
    count: int


def plan(order: list[tuple[Sequence, int]]) -> list[PromptLogprobRows]:
    """The prompt-logprob rows of a flattened batch (the runner's (seq, num_new_tokens) order):
    the positions of each chunk that predict a prompt token not yet given an entry."""
    rows, offset = [], 0
    for seq, n in order:
        k = seq.params.prompt_logprobs
        if k is not None and not seq.spec_token_ids:
            start = seq.num_computed_tokens
            # Position p predicts prompt token p + 1; entries exist for tokens 1 .. len(entries).
            first = max(start, len(seq.prompt_logprobs))
            last = min(start + n, seq.num_prompt_tokens - 1)  # exclusive
            if last > first:
                rows.append(PromptLogprobRows(seq, offset + first - start, first, last - first))
        offset += n
    return rows


ROWS_PER_SLICE = 512  # logits of this many rows at a time: 512 x 151,936 fp32 is 311 MB


def compute(logits_of, hidden: torch.Tensor, rows: list[PromptLogprobRows], vocab_size: int) -> None:
    """Append each planned sequence's prompt logprobs to `seq.prompt_logprobs`. `logits_of`: the
    model's hidden -> logits; run on the planned rows only, a slice of rows at a time (a chunk
    of prefill has up to max_num_batched_tokens of them)."""
    index = torch.cat([torch.arange(r.first_row, r.first_row + r.count) for r in rows]).to(hidden.device)
    targets = torch.tensor([t for r in rows for t in r.seq.token_ids[r.first_position + 1:
                                                                     r.first_position + 1 + r.count]],
                           device=hidden.device)
    k = max(r.seq.params.prompt_logprobs for r in rows)
    actual, ranks, top_values, top_ids = [], [], [], []
    for lo in range(0, len(index), ROWS_PER_SLICE):
        part = slice(lo, lo + ROWS_PER_SLICE)
        logits = logits_of(hidden[index[part]])[:, :vocab_size]
        if cpu_kernels.supports(logits) and logits.stride(-1) == 1:  # read in place: no fp32 log-softmax
            _, values, ids, own, rank = cpu_kernels.logprob_rows(logits, k, targets[part])
            actual += own.tolist()
            ranks += rank.tolist()
            top_values += values.tolist()
            top_ids += ids.tolist()
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        own = logprobs.gather(1, targets[part].view(-1, 1))
        ranks += ((logprobs > own).sum(dim=1) + 1).tolist()
        actual += own.view(-1).tolist()
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_values += values.tolist()
            top_ids += ids.tolist()
    targets = targets.tolist()
    i = 0
    for r in rows:
        n = r.seq.params.prompt_logprobs
        for _ in range(r.count):
            top = dict(zip(top_ids[i][:n], top_values[i][:n])) if n else {}
            r.seq.prompt_logprobs.append(PromptLogprob(targets[i], actual[i], ranks[i], top))
            i += 1
