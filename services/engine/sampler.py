"""Turn the step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Rows with a seed draw from their own generator, a fixed amount per step, so their tokens do not
depend on what else is in the batch. Sampling uses the exponential race (argmax p / E with
E ~ Exp(1)), which equals drawing from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row, when that row asked for logprobs: (chosen logprob, {token id: logprob} top-n).
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.generator = torch.Generator()  # unseeded rows; seeded once so runs are repeatable
        self.generator.manual_seed(0)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        logits = logits[:, :self.vocab_size]
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if any(p.needs_penalties for p in params):
            logits = logits.clone()
            for i, seq in enumerate(seqs):
                if seq.params.needs_penalties:
                    self._apply_penalties(logits[i], seq)

        greedy = [p.greedy for p in params]
        if all(greedy):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = self._sample(logits, seqs, greedy)
        token_ids = chosen.tolist()

        logprob_rows: list[tuple[float, dict[int, float]] | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                row = raw_logprobs[i]
                top: dict[int, float] = {}
                if p.logprobs > 0:
                    values, ids = row.topk(p.logprobs)
                    top = dict(zip(ids.tolist(), values.tolist()))
                logprob_rows[i] = (row[token_ids[i]].item(), top)
        return SampleResult(token_ids, logprob_rows)

    @staticmethod
    def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
        p = seq.params
        if p.repetition_penalty != 1.0:  # as in transformers/CTRL: over prompt and output tokens
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            # As in the OpenAI API: over generated tokens only.
            ids, counts = torch.tensor(seq.output_token_ids, dtype=torch.long).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        n, vocab = logits.shape
        temps = torch.tensor([1.0 if g else s.params.temperature for g, s in zip(greedy, seqs)],
                             dtype=logits.dtype)
        scaled = logits / temps[:, None]
        if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs):
            scaled = self._top_k_top_p(scaled, seqs)
        probs = torch.softmax(scaled, dim=-1)
        min_ps = [s.params.min_p for s in seqs]
        if any(min_ps):
            floor = torch.tensor(min_ps, dtype=probs.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy), logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[1]
        top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else vocab for s in seqs])
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
