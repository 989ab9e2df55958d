"""Speculative decoding in the engine: the one object LLMEngine talks to.

Per step: `propose(batch)` after scheduling gives decoding sequences their drafts (the number
from the adaptive cost model), with slots for them, and turns their one-token entries into
1 + m token entries; the model runner verifies them through the prefill/extend attention path in
the same forward as everything else in the batch, and the Verifier samples (spec_decode.verifier).
The engine appends the emitted tokens one by one, checking stop strings, EOS and max_tokens
each time, so a run that stops early keeps nothing after the stop; an accepted draft's KV
(written by the verification) counts as computed, and its block enters the prefix cache, only
once the token after it is appended, as in a plain run: only accepted tokens enter the hash
chain and the KV events. `verified(batch)` then releases the slots of rejected drafts and
counts acceptance. `observe` feeds the step's wall time to the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from services.engine.block_manager import BlockManager
from services.engine.config import EngineArgs
from services.engine.model_config import ModelConfig
from services.engine.scheduler import ScheduledBatch
from services.engine.spec_decode.adaptive import Acceptance, AdaptivePolicy, Candidate
from services.engine.spec_decode.config import SpeculativeConfig
from services.engine.spec_decode.ngram import NgramProposer
from services.engine.spec_decode.verifier import Verifier


EXPLORE_MIN_SEQS = 4  # a step that measures an arm of the cost model speculates a quarter of the
# batch, at least this many: enough to measure above the noise, few enough to cost little


def explore_seqs(num_decodes: int) -> int:
    return max(EXPLORE_MIN_SEQS, -(-num_decodes // 4))


@dataclass
class SpecState:
    """A sequence's speculative-decoding state (Sequence.spec_state)."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    accepted: int = 0  # drafts accepted at the last verification
    draft_probs: list[torch.Tensor] | None = None  # this step's draft distributions (rejection sampling)
    draft: object = None  # the draft model's DraftState
    draft_params: object = None  # the request's parameters without logprobs, for drafting

    def add_draft_probs(self, probs: torch.Tensor) -> None:
        if self.draft_probs is None:
            self.draft_probs = []
        self.draft_probs.append(probs)


@dataclass
class SpecDecodeStats:
    """Cumulative counts, as vLLM's spec_decode metrics have them."""

    num_drafts: int = 0  # speculated runs verified (one per sequence per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class _StepPlan:
    num_decodes: int = 0
    k: int = 0
    num_speculating: int = 0
    decode_only: bool = False


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, runner, block_manager: BlockManager, args: EngineArgs,
                 model_config: ModelConfig, reserved_blocks: int = 0):
        self.config = config
        self.k = config.num_speculative_tokens
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            from services.engine.spec_decode.draft_model import DraftModelProposer

            self.proposer = DraftModelProposer(config.model, model_config, args, runner.num_blocks)
        self.verifier = Verifier(runner.sampler)
        runner.verifier = self.verifier
        self.block_manager = block_manager
        self.reserved_blocks = reserved_blocks  # left free for the scheduler (its watermark)
        self.max_num_batched_tokens = args.max_num_batched_tokens
        self.policy = AdaptivePolicy(self.k, config.adaptive)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k)
        self._plan = _StepPlan()

    # ---- before the forward ----------------------------------------------------------------
    def propose(self, batch: ScheduledBatch, max_model_len: int) -> None:
        # Structured sequences never draft: each position's token mask follows from the tokens before it.
        decoding = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                    if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1 and seq.grammar is None]
        plan = self._plan = _StepPlan(len(decoding), decode_only=len(decoding) == len(batch.seqs))
        rooms = {}
        for i in decoding:
            seq = batch.seqs[i]
            if seq.spec_state is None:
                seq.spec_state = SpecState(draft_params=msgspec.structs.replace(seq.params, logprobs=None))
            # Drafts beyond max_tokens - 1 or the context could never all be emitted with the token after them.
            room = min(self.k, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens,
                       self.proposer.room(seq))
            if room > 0:
                rooms[i] = room
        if not rooms:
            return
        proposals: dict[int, list[int]] = {}
        if not self.proposer.needs_slots_first:  # cheap: propose first, and only sequences with drafts count
            idx = list(rooms)
            for i, d in zip(idx, self.proposer.propose([batch.seqs[i] for i in idx], [rooms[i] for i in idx])):
                if d:
                    proposals[i], rooms[i] = d, len(d)
            rooms = {i: rooms[i] for i in proposals}
        lags = {i: self.proposer.lag(batch.seqs[i]) for i in rooms}
        candidates = [Candidate(self.policy.acceptance(batch.seqs[i].spec_state.acceptance), r, lags[i],
                                batch.seqs[i].params.max_tokens - batch.seqs[i].num_output_tokens)
                      for i, r in rooms.items()]
        k = plan.k = self.policy.choose(len(decoding), candidates)
        if k == 0:
            return
        if self.policy.exploring:  # measure the arm on the sequences with the least to catch up
            rooms = dict(sorted(rooms.items(), key=lambda item: lags[item[0]]))
        budget = self.max_num_batched_tokens - batch.num_tokens
        granted: dict[int, int] = {}
        for i, room in rooms.items():
            m = min(k, room, budget)
            if m < 1 or (self.policy.exploring and len(granted) == explore_seqs(len(decoding))):
                break
            seq = batch.seqs[i]
            if self.block_manager.blocks_needed(seq, 1 + m) + self.reserved_blocks > self.block_manager.num_free_blocks:
                continue  # speculation never takes blocks the scheduler may need
            self.block_manager.allocate_slots(seq, 1 + m)
            granted[i] = m
            budget -= m
        if self.proposer.needs_slots_first:
            idx = list(granted)
            for i, d in zip(idx, self.proposer.propose([batch.seqs[i] for i in idx], [granted[i] for i in idx])):
                proposals[i] = d
            self.policy.observe_catch_up(self.proposer.catch_up_tokens, self.proposer.catch_up_s)
        for i, m in granted.items():
            seq = batch.seqs[i]
            seq.spec_token_ids = proposals.get(i, [])[:m]
            if len(seq.spec_token_ids) < m:  # the slots of drafts that did not come
                self.block_manager.release_slots(seq, seq.num_tokens + len(seq.spec_token_ids))
            if seq.spec_state.draft_probs is not None:
                del seq.spec_state.draft_probs[len(seq.spec_token_ids):]
            batch.num_new_tokens[i] = 1 + len(seq.spec_token_ids)
            plan.num_speculating += bool(seq.spec_token_ids)

    # ---- after the tokens are appended -------------------------------------------------------
    def verified(self, batch: ScheduledBatch) -> None:
        stats, bm = self.stats, self.block_manager
        for seq in batch.seqs:
            m = len(seq.spec_token_ids)
            if not m:
                continue
            state = seq.spec_state
            a = state.accepted
            stats.num_drafts += 1
            stats.num_draft_tokens += m
            stats.num_accepted_tokens += a
            for j in range(a):
                stats.accepted_per_position[j] += 1
            seq.num_draft_tokens += m
            seq.num_accepted_tokens += a
            self.policy.verified(state.acceptance, a, m)
            if not seq.is_finished:  # a finished one has already freed its blocks
                bm.release_slots(seq, seq.num_tokens)
                self.proposer.verified(seq)
            seq.spec_token_ids = []
            state.draft_probs = None

    def observe(self, step_seconds: float) -> None:
        plan = self._plan
        if plan.decode_only:
            catch_up = self.proposer.catch_up_s if plan.num_speculating else 0.0
            self.policy.observe(plan.num_decodes, plan.k, plan.num_speculating, step_seconds - catch_up)

    def snapshot(self) -> dict:
        s = self.stats
        return {"spec_decode_num_drafts": s.num_drafts, "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_position),
                "spec_decode_steps_by_k": dict(sorted(self.policy.chosen.items()))}
