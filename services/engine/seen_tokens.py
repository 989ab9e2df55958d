"""The ids a sequence has seen, as penalties read them: each distinct id once, in first-seen
order, with how often it occurs among the output tokens.

Kept per sequence and brought up to date incrementally (a decode step adds one token), so a
penalized step costs its new tokens rather than a sort of every row's whole history; the
sampler copies each row's arrays into one rectangle (services.engine.sampler.Penalties).
"""

from __future__ import annotations

import numpy as np

# New tokens above this count (a prompt, a resumed stream) are counted with numpy, not one by one.
BULK_TOKENS = 16


class SeenTokens:
    __slots__ = ("_ids", "_output_counts", "_size", "_consumed", "_slot")

    def __init__(self):
        self._ids = np.empty(64, dtype=np.int64)
        self._output_counts = np.zeros(64, dtype=np.float32)
        self._size = 0  # distinct ids held
        self._consumed = 0  # tokens of the sequence counted so far
        self._slot: dict[int, int] = {}  # id -> its index in _ids

    def update(self, tokens: np.ndarray, num_prompt_tokens: int) -> None:
        """Count tokens[consumed:] (`tokens` only ever grows); those at or past
        num_prompt_tokens are outputs."""
        first = self._consumed
        new = tokens[first:]
        if len(new) > BULK_TOKENS:
            self._add_bulk(new, max(0, num_prompt_tokens - first))
        else:
            for position, token in enumerate(new.tolist(), start=first):
                self._add(token, 1.0 if position >= num_prompt_tokens else 0.0)
        self._consumed = len(tokens)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct ids, their output counts): views, valid until the next update."""
        return self._ids[:self._size], self._output_counts[:self._size]

    def with_outputs(self, extra: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """What arrays() would return after `extra` more output tokens, as copies; this object
        is left as it is (speculative decoding samples rows as if drafts were accepted)."""
        ids, counts = self._ids[:self._size].copy(), self._output_counts[:self._size].copy()
        added: dict[int, int] = {}
        for token in extra:
            slot = self._slot.get(token, added.get(token))
            if slot is None:
                slot = added[token] = len(ids)
                ids, counts = np.append(ids, token), np.append(counts, np.float32(0.0))
            counts[slot] += 1.0
        return ids, counts

    def _add(self, token: int, output: float) -> None:
        slot = self._slot.get(token)
        if slot is None:
            slot = self._append(token)
        self._output_counts[slot] += output

    def _add_bulk(self, new: np.ndarray, outputs_from: int) -> None:
        """new[outputs_from:] are outputs. One numpy pass, then one dict lookup per distinct id."""
        unique, first_index, inverse = np.unique(new, return_index=True, return_inverse=True)
        output_counts = np.bincount(inverse.reshape(-1)[outputs_from:], minlength=len(unique))
        order = np.argsort(first_index, kind="stable")  # first-seen order
        for token, count in zip(unique[order].tolist(), output_counts[order].tolist()):
            self._add(token, float(count))

    def _append(self, token: int) -> int:
        if self._size == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
            self._output_counts = np.concatenate([self._output_counts, np.zeros_like(self._output_counts)])
        slot = self._size
        self._ids[slot] = token
        self._slot[token] = slot
        self._size += 1
        return slot
