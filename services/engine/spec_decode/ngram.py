"""N-gram proposals (prompt lookup, as vLLM's `ngram` method): the longest suffix of the sequence,
between prompt_lookup_min and prompt_lookup_max tokens, that occurred earlier in the prompt or
output; the tokens that followed its latest earlier occurrence are the drafts. No model runs:
a proposal costs a pass over the token array."""

from __future__ import annotations

import numpy as np


def ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens for the sequence `tokens` (int64), or [] when no suffix of at least
    min_n tokens occurred before. Among matches of the longest length the latest wins (the span
    being copied now is the likeliest to go on)."""
    length = len(tokens)
    if length < min_n + 1 or k < 1:
        return []
    # Earlier positions i whose token equals the last one: a match would end there.
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched so far at each end
    for j in range(1, max_n):
        at = ends - j
        ok = (matched == j) & (at >= 0)
        ok[ok] = tokens[at[ok]] == tokens[length - 1 - j]
        if not ok.any():
            break
        matched += ok
    longest = int(matched.max())
    if longest < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == longest)[-1]])
    return tokens[end + 1:end + 1 + k].tolist()


class NgramProposer:
    """Proposals for many sequences at once (the engine's interface for proposers)."""

    needs_slots_first = False  # reads tokens only: slots are allocated for what it proposes
    catch_up_s, catch_up_tokens = 0.0, 0  # nothing to catch up

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    @staticmethod
    def room(seq) -> int:
        return len(seq.token_ids)  # no limit of its own

    @staticmethod
    def lag(seq) -> int:
        return 0

    @staticmethod
    def verified(seq) -> None:
        """Nothing to update: a lookup keeps no state."""

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [ngram_proposal(seq.token_array(), self.min_n, self.max_n, k) if k else []
                for seq, k in zip(seqs, ks)]
