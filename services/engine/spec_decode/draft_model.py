"""Draft-model proposals: a smaller model with the target's tokenizer, run by a ModelRunner of its
own in the same engine, with its own paged KV cache.

The draft's cache has as many blocks as the target's and the same block size, and a sequence's
draft KV lives in the blocks of the target's block table: the target's block manager allocates
and frees both at once, so the draft can leak no block, and a preempted sequence loses both. A
sequence's draft KV is valid for its first `DraftState.computed` tokens; each proposal first
catches it up to the sequence's last token (one forward over whatever is missing: the prompt
on the first proposal, the accepted tokens after a verification), then drafts one token per
forward.

Drafts are drawn by the draft's own Sampler with the request's parameters at the output
position they would take: greedy rows by argmax, seeded rows from the same counter uniforms the
target's sampler will use to verify them (so close distributions draw the same token), others
from its generator, with the distribution kept for rejection sampling.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from services.engine.config import EngineArgs
from services.engine.model_config import ModelConfig
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import ScheduledBatch
from services.engine.spec_decode.verifier import ExtendedSequence


class DraftView:
    """A sequence as the draft model's runner sees it: the target's tokens (and drafts so far)
    and block table, the draft's own count of computed tokens."""

    __slots__ = ("seq", "token_ids", "block_table", "num_computed_tokens", "spec_token_ids")

    def __init__(self, seq, computed: int):
        self.seq = seq
        self.token_ids = list(seq.token_ids)
        self.block_table = seq.block_table
        self.num_computed_tokens = computed
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class DraftState:
    computed: int = 0  # tokens of the sequence whose draft KV is in the draft's cache
    preemptions: int = 0  # the sequence's preemption count it was computed under


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Refuse a draft model whose vocabulary differs from the target's (its probabilities would
    be over other tokens)."""
    target, draft = ModelConfig.load(target_dir), ModelConfig.load(draft_dir)
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's vocabulary ({draft.vocab_size}) is not the "
                         f"target's ({target.vocab_size}); a draft model needs the target's tokenizer")
    files = [Path(d) / "tokenizer.json" for d in (target_dir, draft_dir)]
    if all(f.is_file() for f in files):
        vocabs = [json.loads(f.read_text()).get("model", {}).get("vocab") for f in files]
        if vocabs[0] != vocabs[1]:
            raise ValueError("speculative_config.model: the draft model's tokenizer is not the target's")


class DraftModelProposer:
    needs_slots_first = True  # writes its KV into the slots of the tokens it drafts

    def __init__(self, draft_dir: str | Path, target: ModelConfig, args: EngineArgs, num_blocks: int):
        check_same_tokenizer(target.path, Path(draft_dir))
        self.config = ModelConfig.load(draft_dir)
        draft_args = dataclasses.replace(args, num_kv_blocks=num_blocks, speculative_config=None,
                                         enable_cuda_graphs=False)
        self.runner = ModelRunner(self.config, draft_args)
        self.sampler = self.runner.sampler
        self.max_tokens_per_forward = args.max_num_batched_tokens
        self.max_positions = self.config.max_position_embeddings
        self.catch_up_s = 0.0  # the last proposal's catch-up forwards (see propose), and their tokens
        self.catch_up_tokens = 0

    def state(self, seq) -> DraftState:
        state = seq.spec_state.draft
        if state is None or state.preemptions != seq.num_preemptions:  # preempted: its blocks were freed
            state = seq.spec_state.draft = DraftState(0, seq.num_preemptions)
        return state

    def room(self, seq) -> int:
        """Drafts the draft model can place after seq's last token (its position limit)."""
        return max(self.max_positions - seq.num_tokens, 0)

    def lag(self, seq) -> int:
        """Tokens of seq a proposal would catch up on before drafting (see propose)."""
        behind = seq.num_tokens - self.state(seq).computed
        return behind - 1 if behind > 2 else 0

    def verified(self, seq) -> None:
        """After seq's verification: its draft KV stays valid only up to the accepted tokens."""
        state = self.state(seq)
        state.computed = min(state.computed, seq.num_computed_tokens)

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts for seqs[i] (its slots already allocated). A sampled, unseeded
        sequence also gets its draft distributions in `spec_state.draft_probs`."""
        drafts: list[list[int]] = [[] for _ in seqs]
        views = {i: DraftView(seq, self.state(seq).computed) for i, (seq, k) in enumerate(zip(seqs, ks)) if k > 0}
        # Sequences more than the usual two tokens behind (a prompt not seen yet, steps without
        # speculation) first catch up to their last token but one: timed apart (`catch_up_s`),
        # since it is paid once, not per step.
        start = time.perf_counter()
        behind = {i: v.num_tokens - 1 for i, v in views.items() if v.num_tokens - v.num_computed_tokens > 2}
        self.catch_up_tokens = sum(target - views[i].num_computed_tokens for i, target in behind.items())
        self._catch_up(behind, seqs, views, drafts)
        self.catch_up_s = time.perf_counter() - start
        self._catch_up({i: v.num_tokens for i, v in views.items()}, seqs, views, drafts)  # the first drafts
        # Then one token per forward for the sequences that want more.
        while True:
            entries = [(i, 1) for i, view in views.items() if len(drafts[i]) < ks[i]]
            if not entries:
                break
            for i, _ in entries:
                views[i].token_ids.append(drafts[i][-1])
            self._forward(seqs, views, entries, drafts)
        for i, view in views.items():
            self.state(seqs[i]).computed = view.num_computed_tokens
        return drafts

    def _catch_up(self, targets: dict[int, int], seqs, views, drafts) -> None:
        """Forward each views[i] up to targets[i] tokens, in forwards of at most
        max_tokens_per_forward tokens; a view that reaches its last token drafts one."""
        waiting = sorted(targets, key=lambda i: targets[i] - views[i].num_computed_tokens)
        while waiting:
            budget, entries = self.max_tokens_per_forward, []
            for i in waiting:
                n = min(targets[i] - views[i].num_computed_tokens, budget)
                if n < 1:
                    break
                entries.append((i, n))
                budget -= n
            self._forward(seqs, views, entries, drafts)
            waiting = [i for i in waiting if views[i].num_computed_tokens < targets[i]]

    def _forward(self, seqs, views, entries, drafts) -> None:
        """One draft forward over `entries` ((index, tokens)); every view that reaches its last
        token drafts one token."""
        batch = ScheduledBatch([views[i] for i, _ in entries], [n for _, n in entries])
        sampled_views, logits = self.runner.compute_logits(batch)
        for i, n in entries:
            views[i].num_computed_tokens += n
        if logits is None:
            return
        index = {id(views[i]): i for i, _ in entries}
        order = [index[id(v)] for v in sampled_views]
        rows = [ExtendedSequence(seqs[i], drafts[i], seqs[i].spec_state.draft_params) for i in order]
        sampling = self.sampler.prepare(rows)
        want_probs = [j for j, i in enumerate(order) if uses_rejection_later(seqs[i])]
        probs = self.sampler.probs(logits, sampling) if want_probs else None
        tokens = self.sampler.sample(logits, sampling).token_ids
        for j, i in enumerate(order):
            drafts[i].append(tokens[j])
        for j in want_probs:
            seqs[order[j]].spec_state.add_draft_probs(probs[j])


def uses_rejection_later(seq) -> bool:
    """Whether seq's drafts will be verified by rejection sampling (so their distribution is kept)."""
    return not seq.params.greedy and seq.params.seed is None
