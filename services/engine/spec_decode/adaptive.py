"""How many tokens to speculate this step: the measured cost model (pure logic, no I/O).

Speculating k tokens for a sequence whose drafts are accepted with probability a each (given the
ones before were) yields 1 + a + a^2 + ... + a^k tokens per step instead of 1, and costs what
verifying k more tokens and proposing them adds to the step. Both are measured here:

- cost, per batch-size bucket (B = sequences decoding): `base`, the seconds per sequence of a
  step without speculation, and per draft length k and number of speculating sequences (on the
  same half-octave grid), `extra[k, S]`, the seconds each speculating sequence adds to the step.
  Keyed on S because the cost per speculating sequence grows with S where verification (and a
  draft model) turn compute-bound: an arm explored with a quarter of the batch underestimates
  speculating all of it. A step priced from a smaller S's measurement (optimistic) measures its
  own S, so a wrong guess costs one step per arm. Costs do not depend on acceptance, so an arm
  measured once stays valid while requests come and go; arms are re-measured when they go stale.
- gain, per sequence: its acceptance rate so far, shrunk towards the engine-wide rate while it
  has few verifications of its own.

Each step takes the k (0 included) with the most tokens per second,

    rate(k) = (B + sum_s (E_s(k) - 1)) / (B * base + S * extra[k, S] + catch_up(k)),

(catch_up below) and speculates only if that beats rate(0) = 1 / base by `margin`. Arms are explored one step at
a time, at most one step in `explore_gap` per bucket, and every arm again after `refresh_steps`
steps; an exploring step speculates a quarter of the batch only (decoder.explore_seqs), so it
costs little even at a large batch where the arm turns out to lose, and picks the sequences a
draft model has already caught up with.

A draft model's catch-up forwards (a prompt it has not seen, tokens decoded while speculation
was off) are left out of the step time the arms see: they are paid once per sequence, not per
step. They are priced apart, per token (`catch_up`), and a step that would make sequences catch
up pays its share of it: catch_up(k) sums, over them, the catch-up tokens times the seconds per
token times the share of the remaining output the step yields (E_s(k) / remaining_s, at most 1). So a short
request behind a long prompt does not speculate at a large batch, where the step gains a few
percent, and does at batch 1, where it gains several times the cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step yields with k drafts accepted with probability `acceptance` each in turn."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def bucket(num_decodes: int) -> int:
    """Batch sizes on a half-octave grid (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, ...)."""
    return max(1, int(round(2 ** (round(2 * math.log2(max(num_decodes, 1))) / 2))))


class Candidate(NamedTuple):
    """A decoding sequence that could speculate this step."""

    acceptance: float  # its expected acceptance rate
    room: int  # drafts it can take
    catch_up: int = 0  # tokens the proposer must process before drafting (a draft model behind it)
    remaining: int = 1 << 30  # output tokens it may still produce


@dataclass
class _Ema:
    value: float = 0.0
    count: int = 0
    last_step: int = -1

    def add(self, x: float, weight: float, step: int) -> None:
        self.value = x if self.count == 0 else (1 - weight) * self.value + weight * x
        self.count += 1
        self.last_step = step


@dataclass
class _Bucket:
    base: _Ema = field(default_factory=_Ema)
    extra: dict[tuple[int, int], _Ema] = field(default_factory=dict)  # (k, bucket(speculating)) -> seconds each

    def arm_cost(self, k: int, speculating: int, fresh) -> _Ema | None:
        """extra[k, S] for S speculating sequences: measured at S's bucket, else at the largest
        smaller one measured (an underestimate the step then corrects); None if k has none fresh."""
        want = bucket(speculating)
        known = [(s, ema) for (arm, s), ema in self.extra.items() if arm == k and s <= want and fresh(ema)]
        return max(known, key=lambda item: item[0])[1] if known else None

    def explored(self, k: int, fresh) -> bool:
        return any(arm == k and fresh(ema) for (arm, _), ema in self.extra.items())
    last_explore: int = -(1 << 30)


@dataclass
class Acceptance:
    """Drafts verified and accepted: per sequence, and engine-wide (decayed, so it follows the
    current workload)."""

    trials: float = 0.0  # draft positions verified up to and including the first rejection
    accepted: float = 0.0

    def add(self, accepted: int, num_drafts: int, decay: float = 1.0) -> None:
        self.trials = decay * self.trials + accepted + (1 if accepted < num_drafts else 0)
        self.accepted = decay * self.accepted + accepted

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior * prior_weight) / (self.trials + prior_weight)


class AdaptivePolicy:
    def __init__(self, max_k: int, adaptive: bool = True, *, margin: float = 0.03, ema: float = 0.25,
                 explore_gap: int = 4, refresh_steps: int = 1024, prior: float = 0.5, prior_weight: float = 4.0,
                 global_decay: float = 0.995):
        self.max_k, self.adaptive = max_k, adaptive
        self.arms = sorted({max_k >> i for i in range(max_k.bit_length()) if max_k >> i >= 1})  # k, k/2, ..., 1
        self.margin, self.ema, self.explore_gap, self.refresh_steps = margin, ema, explore_gap, refresh_steps
        self.prior, self.prior_weight, self.global_decay = prior, prior_weight, global_decay
        self.buckets: dict[int, _Bucket] = {}
        self.engine_acceptance = Acceptance()
        self.catch_up = _Ema()  # seconds per catch-up token of the proposer
        self.step = 0
        self.exploring = False  # the last choice measures an arm (the engine speculates few sequences then)
        self.chosen: dict[int, int] = {}  # k -> steps that chose it

    # ---- acceptance ------------------------------------------------------------------------
    def acceptance(self, own: Acceptance | None) -> float:
        """A sequence's expected acceptance rate, from its own verifications and the engine's."""
        engine = self.engine_acceptance.rate(self.prior, self.prior_weight)
        return own.rate(engine, self.prior_weight) if own is not None else engine

    def verified(self, own: Acceptance, accepted: int, num_drafts: int) -> None:
        own.add(accepted, num_drafts)
        self.engine_acceptance.add(accepted, num_drafts, self.global_decay)

    # ---- cost ------------------------------------------------------------------------------
    def choose(self, num_decodes: int, candidates: list[Candidate]) -> int:
        """k for a step with `num_decodes` decoding sequences, of which `candidates` could
        speculate."""
        self.step += 1
        self.exploring = False
        k = self._choose(num_decodes, candidates)
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def _choose(self, num_decodes: int, candidates: list[Candidate]) -> int:
        if not candidates:
            return 0
        if not self.adaptive:
            return self.max_k
        cell = self.buckets.setdefault(bucket(num_decodes), _Bucket())
        if cell.base.count < 2 or self._stale(cell.base):
            return 0
        def fresh(ema: _Ema) -> bool:
            return not self._stale(ema)

        if self.step - cell.last_explore >= self.explore_gap:
            for k in reversed(self.arms):  # the longest first: the arm that gains most when drafts are good
                if not cell.explored(k, fresh):
                    cell.last_explore = self.step
                    self.exploring = True
                    return k
        base = cell.base.value
        best, best_rate = 0, (1.0 + self.margin) / base
        n_spec = sum(1 for c in candidates if c.room > 0)
        per_token = self.catch_up.value if self.catch_up.count else 0.0
        for k in self.arms:
            arm = cell.arm_cost(k, n_spec, fresh)
            if arm is None:
                continue
            gain = catch_up = 0.0
            for c in candidates:
                tokens = expected_tokens(c.acceptance, min(k, c.room))
                gain += tokens - 1.0
                if c.catch_up:
                    catch_up += c.catch_up * per_token * min(1.0, tokens / max(c.remaining, 1))
            rate = (num_decodes + gain) / (num_decodes * base + n_spec * max(arm.value, 0.0) + catch_up)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _stale(self, ema: _Ema) -> bool:
        return self.step - ema.last_step > self.refresh_steps

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The proposer caught sequences up by `tokens` tokens in `seconds`."""
        if tokens > 0 and self.adaptive:
            self.catch_up.add(seconds / tokens, self.ema, self.step)

    def observe(self, num_decodes: int, k: int, num_speculating: int, seconds: float) -> None:
        """A step of decodes only (no prefill in it) took `seconds`, with k drafts for
        `num_speculating` of its `num_decodes` sequences."""
        if num_decodes < 1 or not self.adaptive:
            return
        cell = self.buckets.setdefault(bucket(num_decodes), _Bucket())
        if k == 0 or num_speculating == 0:
            cell.base.add(seconds / num_decodes, self.ema, self.step)
        elif cell.base.count:
            extra = (seconds - num_decodes * cell.base.value) / num_speculating
            cell.extra.setdefault((k, bucket(num_speculating)), _Ema()).add(extra, self.ema, self.step)
