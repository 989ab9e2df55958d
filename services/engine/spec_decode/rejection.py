"""Verifying drafts: which proposed tokens a target model accepts, and the token after them.

Two exact rules, both leaving the target's output distribution (after every filter of the
sampler: temperature, top-k/top-p/min-p, penalties) unchanged:

- Match (greedy rows, seeded rows, and every row whose drafts were proposed without a
  distribution, such as n-gram lookups): the sampler draws the target's token at every
  verified position exactly as it would without speculation (seeded rows from their counter
  uniforms keyed on (seed, position, round)); drafts are accepted while they equal those
  draws, and the first draw that differs is the next token. The output is then the very
  output of non-speculative decoding: greedy output token for token, a seeded request's output
  whatever else is in the batch and however many drafts it got. For a draft that is a point
  mass this is also the optimal rejection rule (a draft d is accepted with probability p(d)).
- Rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for unseeded sampled rows whose
  drafts a draft model sampled from its own distribution q: accept d with probability
  min(1, p(d) / q(d)); at the first rejection draw from normalize(max(p - q, 0)); after k
  accepted drafts draw the next token from p. This accepts more than matching when q ~ p.
"""

from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for n sequences at once.

    target_probs [n, K + 1, V]: the target's filtered distribution at every verified position
    (row j: after j drafts); draft_probs [n, K, V]: the distributions the drafts were drawn
    from; draft_ids [n, K]; num_drafts [n] (rows past a sequence's own drafts are padding).
    Returns (accepted [n]: drafts accepted, next_token [n]: the token after them)."""
    n, k = draft_ids.shape
    ids = draft_ids.unsqueeze(-1)
    p = target_probs[:, :k].gather(2, ids).squeeze(-1)
    q = draft_probs.gather(2, ids).squeeze(-1)
    u = torch.rand((n, k), generator=generator, dtype=torch.float32)
    accept = (u * q < p) & (torch.arange(k)[None, :] < num_drafts[:, None])  # u < p / q without dividing
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    rows = torch.arange(n)
    p_next = target_probs[rows, accepted]
    rejected = (accepted < num_drafts).unsqueeze(-1)
    q_next = draft_probs[rows, accepted.clamp(max=k - 1)]
    residual = torch.where(rejected, (p_next - q_next).clamp_(min=0.0), p_next)
    mass = residual.sum(dim=-1, keepdim=True)
    # A rejection needs p(d) < q(d), so p - q has positive mass elsewhere; only rounding leaves none.
    residual = torch.where(mass > 0, residual, p_next)
    next_token = torch.multinomial(residual, 1, generator=generator).view(-1)
    return accepted, next_token


def match_drafts(draft_ids: list[int], sampled: list[int]) -> int:
    """Drafts accepted by the match rule: how many lead `sampled` (the target's draws at each
    verified position, one more than there are drafts)."""
    accepted = 0
    for d, t in zip(draft_ids, sampled):
        if d != t:
            break
        accepted += 1
    return accepted
