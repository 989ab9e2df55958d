"""Incremental detokenization with stop strings.

Text is produced by decoding a sliding window of tokens and emitting only what extends the
previous decode, so a multi-byte character split across tokens is emitted once complete (never
as U+FFFD), and word-boundary spaces come out right. Stop strings are searched across token
boundaries; text that could still be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Tokens of context before the first new token, so leading spaces decode as in the full text.
_INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.prefix_offset = max(len(prompt_token_ids) - _INITIAL_CONTEXT, 0)
        self.read_offset = len(prompt_token_ids)
        self.output_text = ""
        self.sent_offset = 0  # characters of output_text already returned by take_delta()
        self.stopped = False  # a stop string ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, all_token_ids: list[int], check_stop: bool = True) -> bool:
        """Account for newly appended tokens; returns True when a stop string was found
        (never with check_stop False: min_tokens not reached yet)."""
        prefix_text = self._decode(all_token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(all_token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence: wait for the next token
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(all_token_ids)
        start = max(len(self.output_text) - self.holdback, 0)
        self.output_text += delta
        if not self.stop or not check_stop:
            return False
        best = -1
        for s in self.stop:  # earliest match in the region the new text can complete
            i = self.output_text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, match = i, s
        if best == -1:
            return False
        self.output_text = self.output_text[:best + (len(match) if self.include_stop else 0)]
        self.stopped = True
        return True

    def flush(self, all_token_ids: list[int]) -> None:
        """At the end of a request that no stop string ended: the text of tokens still held
        back for an incomplete UTF-8 character, as the tokenizer decodes it (U+FFFD), so the
        whole output equals the tokenizer's decode of the same ids."""
        if self.stopped or self.read_offset >= len(all_token_ids):
            return
        prefix_text = self._decode(all_token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(all_token_ids[self.prefix_offset:])
        self.output_text += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(all_token_ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; while running, keep back what may start a stop string."""
        end = len(self.output_text) if finished or not self.stop else len(self.output_text) - self.holdback
        if end <= self.sent_offset:
            return ""
        delta = self.output_text[self.sent_offset:end]
        self.sent_offset = end
        return delta
