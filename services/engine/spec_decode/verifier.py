"""The sampler of steps that verify drafts. The model runner hands it the step's sampling rows:
a plain sequence has one, a sequence with m drafts m + 1 consecutive rows (the target's logits
after its last token and after each draft). Every row is sampled with the engine's Sampler as
the sequence would stand with the drafts before it accepted (penalties and seeded positions
included), then the drafts are accepted by the rules of spec_decode.rejection."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.sampler import Sampler, SampleResult, SamplingBatch
from services.engine.spec_decode.rejection import match_drafts, rejection_sample


class ExtendedSequence:
    """A sequence as it would be with `extra` tokens appended: what Sampler.prepare reads of
    it (parameters and logits processors, output position, the ids that penalties count)."""

    __slots__ = ("seq", "extra", "params", "processors", "num_prompt_tokens")

    def __init__(self, seq, extra: list[int], params=None):
        self.seq, self.extra = seq, extra
        self.params = params if params is not None else seq.params
        self.processors = seq.processors
        self.num_prompt_tokens = seq.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)

    def token_array(self) -> np.ndarray:
        base = self.seq.token_array()
        return np.concatenate([base, np.asarray(self.extra, dtype=np.int64)]) if self.extra else base

    def seen_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.seq.seen_tokens().with_outputs(self.extra)


@dataclass
class _Group:
    seq: object
    first_row: int  # in the step's sampling rows
    num_drafts: int
    rejection: bool  # drafts drawn from a draft distribution: rejection sampling; else matching
    rows: list[int] = field(default_factory=list)  # its rows within its path's batch


@dataclass
class VerifyBatch:
    groups: list[_Group]
    match_rows: list[int]  # step rows sampled by the match rule (plain sequences' rows included)
    match: SamplingBatch
    rejection_rows: list[int]
    rejection: SamplingBatch | None


def uses_rejection(seq) -> bool:
    """Whether seq's drafts are verified by rejection sampling: a sampled, unseeded request
    whose drafts came with their draft distribution."""
    state = seq.spec_state
    return (bool(seq.spec_token_ids) and state is not None and state.draft_probs is not None
            and not seq.params.greedy and seq.params.seed is None)


class Verifier:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def prepare(self, seqs: list) -> VerifyBatch:
        groups: list[_Group] = []
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            m = len(seq.spec_token_ids) if i + 1 < len(seqs) and seqs[i + 1] is seq else 0
            groups.append(_Group(seq, i, m, m > 0 and uses_rejection(seq)))
            i += m + 1
        match_rows, match_views, rej_rows, rej_views = [], [], [], []
        for g in groups:
            rows, views = (rej_rows, rej_views) if g.rejection else (match_rows, match_views)
            for j in range(g.num_drafts + 1):
                g.rows.append(len(rows))
                rows.append(g.first_row + j)
                views.append(g.seq if j == 0 else ExtendedSequence(g.seq, g.seq.spec_token_ids[:j]))
        return VerifyBatch(groups, match_rows, self.sampler.prepare(match_views), rej_rows,
                           self.sampler.prepare(rej_views) if rej_views else None)

    def sample(self, logits: torch.Tensor, batch: VerifyBatch) -> tuple[list, SampleResult]:
        """The tokens of the step in order, with the sequence of each: a verifying sequence gets
        its accepted drafts and the token after them. Sets each one's `spec_state.accepted`."""
        num_rows = logits.shape[0]
        matched = None
        if batch.match_rows:
            rows = batch.match_rows
            part = logits if len(rows) == num_rows else logits[torch.tensor(rows, device=logits.device)]
            matched = self.sampler.sample(part, batch.match)
        rejected = self._rejection(logits, batch) if batch.rejection is not None else None
        seqs, tokens, logprobs = [], [], []
        for g in batch.groups:
            result = rejected if g.rejection else matched
            drawn = [result.token_ids[r] for r in g.rows]
            if g.num_drafts and not g.rejection:
                g.seq.spec_state.accepted = match_drafts(g.seq.spec_token_ids, drawn)
            emitted = g.rows[:g.seq.spec_state.accepted + 1] if g.num_drafts else g.rows
            for r in emitted:
                seqs.append(g.seq)
                tokens.append(result.token_ids[r])
                logprobs.append(result.logprobs[r])
        return seqs, SampleResult(tokens, logprobs)

    def _rejection(self, logits: torch.Tensor, batch: VerifyBatch) -> SampleResult:
        """Rejection sampling of the groups that need it (sets their `spec_state.accepted`).
        Returns, per row of the rejection batch, the token emitted there: the draft where it was
        accepted, then the next token; -1 on the rows after that."""
        rows = torch.tensor(batch.rejection_rows, device=logits.device)
        part = logits.index_select(0, rows)
        raw = self.sampler.raw_logprobs(part, batch.rejection)
        probs = self.sampler.probs(part, batch.rejection)
        groups = [g for g in batch.groups if g.rejection]
        k = max(g.num_drafts for g in groups)
        vocab = probs.shape[1]
        target = probs.new_zeros((len(groups), k + 1, vocab))
        draft = probs.new_zeros((len(groups), k, vocab))
        ids = torch.zeros((len(groups), k), dtype=torch.int64)
        for i, g in enumerate(groups):
            m = g.num_drafts
            target[i, :m + 1] = probs[g.rows[0]:g.rows[0] + m + 1]
            draft[i, :m] = torch.stack(g.seq.spec_state.draft_probs[:m]).to(probs.device)
            ids[i, :m] = torch.tensor(g.seq.spec_token_ids)
        num_drafts = torch.tensor([g.num_drafts for g in groups])
        accepted, next_token = rejection_sample(target.cpu(), draft.cpu(), ids, num_drafts, self.sampler.generator)
        chosen = torch.full((len(batch.rejection_rows),), -1, dtype=torch.int64)
        for i, g in enumerate(groups):
            a = g.seq.spec_state.accepted = int(accepted[i])
            chosen[g.rows[0]:g.rows[0] + a] = ids[i, :a]
            chosen[g.rows[0] + a] = next_token[i]
        logprobs = self.sampler.logprob_results(raw, batch.rejection, chosen.clamp(min=0).to(logits.device))
        return SampleResult(chosen.tolist(), logprobs)
