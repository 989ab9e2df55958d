"""n > 1: one request, several choices, forked from one sequence after its prefill.

The request's first sequence (choice 0) prefills the prompt alone. In the step that completes
that prefill, before its first token is appended, the other choices are forked from it: each
shares the prompt's full KV blocks by reference count and gets a copy of the last, partial
block (a shared block is never written), and stands one token short of the prompt, so its next
step recomputes the prompt's last position into its own block and samples its own first token
from it (one decode-sized step, no second prefill). A choice that finds no free block for its
copy is queued to prefill from scratch instead (the prefix cache still serves its full blocks).

Each choice has its own index, seed stream (seed_for_choice) and finish reason; the request is
finished when every choice is, and its usage counts the prompt once.
"""

from __future__ import annotations

import hashlib

import msgspec

from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.engine.sequence import Sequence, SequenceStatus


def check_resumable(params: SamplingParams, generated: int) -> None:
    """A resumed stream (protocol.Resume) continues one completion (refused with n > 1) that
    has tokens left: its max_tokens is the whole stream's, the `generated` ones included."""
    if generated and params.n > 1:
        raise InvalidRequestError("n: a resumed stream continues one choice; n must be 1", "n")
    if generated and generated >= params.max_tokens:
        raise InvalidRequestError(f"max_tokens: a resumed stream with {generated} tokens generated has none left "
                                  f"of max_tokens {params.max_tokens}", "max_tokens")


def seed_for_choice(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the request's seed (n=1 output is unchanged); choice i > 0 draws from a
    stream of its own, a pure function of (seed, i), so seeded n > 1 output is reproducible."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class ChoiceGroup:
    """The sequences of one request with n > 1: `seqs[i]` is choice i; seqs[0] is the one the
    engine schedules first and forks from."""

    def __init__(self, first: Sequence, n: int, make_seq):
        """make_seq(params) builds a fresh sequence of the same request and prompt."""
        self.seqs = [first]
        for index in range(1, n):
            params = msgspec.structs.replace(first.params, seed=seed_for_choice(first.params.seed, index))
            seq = make_seq(params)
            seq.index, seq.group = index, self
            self.seqs.append(seq)
        first.group = self
        self.forked = False  # seqs[1:] are not in the scheduler until the fork
        self.final_outputs = 0  # choices whose final output has been made

    @property
    def n(self) -> int:
        return len(self.seqs)

    def ready_to_fork(self, seq: Sequence) -> bool:
        """seq is choice 0 and this step computed the last of its prompt (its first token comes next)."""
        return (not self.forked and seq is self.seqs[0] and seq.num_output_tokens == 0
                and seq.num_computed_tokens == seq.num_tokens)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.seqs)


def fork(group: ChoiceGroup, scheduler, copy_block) -> None:
    """Fork choices 1..n-1 from choice 0, whose prompt KV is all computed. copy_block(src, dst)
    copies one KV block (every layer) on the device."""
    first = group.seqs[0]
    group.forked = True
    bm = scheduler.block_manager
    for seq in group.seqs[1:]:
        if seq.is_finished:  # aborted before the fork
            continue
        copy = bm.fork(first, seq, first.num_tokens - 1)
        if copy is False:  # no block for its copy now: it prefills like a new request
            scheduler.add_front(seq)
            continue
        if copy is not None:
            copy_block(*copy)
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_time = first.first_scheduled_time
        scheduler.add_running(seq)
