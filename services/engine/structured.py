"""Structured outputs: a request's JSON schema, JSON object, regex, choice or EBNF grammar
(shared.protocol.StructuredSpec) enforced with xgrammar token masks.

- `StructuredOutputs.compile(spec)` turns a spec into xgrammar's CompiledGrammar, cached by spec
  (LRU). It is the slow part (a JSON schema against the vocabulary: tens to hundreds of ms), so
  callers run it off the step loop first (the engine service in an executor, the offline LLM on
  the caller's thread); the step loop only ever takes it from the cache. A spec that cannot be
  compiled raises InvalidRequestError with xgrammar's reason.
- `matcher(spec, replay)`: one GrammarMatcher per sequence; `replay` (the tokens a migrated
  stream already delivered, protocol.Resume) is fed in first, so the stream continues in the
  grammar state it left.
- Per step, `prepare_masks(seqs)` (host, with the sampler's prepare) fills one bitmask row per
  structured sequence; `apply_masks(logits, masks)` (on the logits' device, before penalties
  and sampling) sets the disallowed tokens to -inf; `advance(seq, token)` moves the matcher on
  by every appended token. The matcher allows EOS once the grammar can end, so a constrained
  output ends on its own; the engine also stops a sequence whose grammar has terminated.
- Speculative decoding does not draft for structured sequences (spec_decode.decoder): their
  masks depend on every token before them.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

from services.engine.sampling_params import InvalidRequestError
from shared.protocol import StructuredSpec

CACHE_ENTRIES = 256  # compiled grammars kept (LRU); a JSON schema's is ~100 KB to a few MB
# JSON output: whitespace between tokens is allowed (as vLLM's default) but bounded, so a model
# cannot stall in an endless run of spaces and newlines.
MAX_JSON_WHITESPACE = 4
_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def spec_key(spec: StructuredSpec) -> tuple:
    kind = spec.kind
    value = getattr(spec, kind)
    return kind, tuple(value) if isinstance(value, list) else value


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings (JSON string literals are EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class StepMasks:
    """One step's token masks: bitmask row i constrains logits row i, for i in rows."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [batch rows, ceil(vocab / 32)], xgrammar's layout


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_threads: int = 2):
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0

    # ---- compile: off the step loop, cached ----------------------------------------------------
    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        key = spec_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return compiled
        compiled = self._compile(spec)  # outside the lock: concurrent compiles of different specs
        with self._lock:
            self.cache_misses += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return self.compiler.compile_json_schema(schema, any_whitespace=True,
                                                         max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                                         max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "regex":
                return self.compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(spec.choice))
            return self.compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar's parse / compile errors (its own types, RuntimeError, ValueError)
            lines = str(exc).strip().splitlines()
            reason = _SOURCE_LOCATION.sub("", lines[-1]) if lines else type(exc).__name__
            raise InvalidRequestError(f"structured_outputs.{kind}: cannot be compiled: {reason}",
                                      f"structured_outputs.{kind}") from None

    # ---- per sequence --------------------------------------------------------------------------
    def matcher(self, spec: StructuredSpec, replay: list[int] = ()) -> xgr.GrammarMatcher:
        """A fresh matcher for one sequence, advanced by `replay` (a resumed stream's delivered
        tokens); InvalidRequestError if they do not follow the grammar."""
        m = xgr.GrammarMatcher(self.compile(spec))
        for i, token in enumerate(replay):
            if not m.accept_token(token):
                raise InvalidRequestError(f"structured_outputs: the resumed stream's token {i} ({token}) does "
                                          f"not follow its grammar", f"structured_outputs.{spec.kind}")
        return m

    # ---- per step ------------------------------------------------------------------------------
    def prepare_masks(self, seqs, device: torch.device) -> StepMasks | None:
        """Bitmask rows for the structured sequences among a step's sampling rows (None: none)."""
        rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)  # fresh: a step may prepare twice
        for i in rows:
            seqs[i].grammar.fill_next_token_bitmask(bitmask, i)
        return StepMasks(rows, bitmask if device.type == "cpu" else bitmask.to(device, non_blocking=True))


def apply_masks(logits: torch.Tensor, masks: StepMasks, vocab_size: int) -> torch.Tensor:
    """Disallowed tokens of the masked rows to -inf, in place (logits: [rows, vocab_size])."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous():
        xgr.apply_token_bitmask_inplace(logits, masks.bitmask, vocab_size=vocab_size, indices=masks.rows)
        return logits
    # xgrammar's CPU kernel takes contiguous fp32 only: unpack the bits with torch on the logits' device.
    index = torch.tensor(masks.rows, device=logits.device)
    bits = masks.bitmask.to(logits.device).index_select(0, index)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(bits.shape[0], -1)[:, :vocab_size]
    rows = logits.index_select(0, index)
    rows.masked_fill_(~allowed[:, :rows.shape[1]], float("-inf"))
    logits.index_copy_(0, index, rows)
    return logits


def advance(seq, token: int) -> bool:
    """Move seq's matcher on by its new token; True when its grammar has ended (nothing more
    may follow)."""
    m = seq.grammar
    if not m.accept_token(token):  # the mask allowed it, so this is a bug, not bad input
        raise RuntimeError(f"{seq.request_id}: token {token} rejected by its grammar after masking")
    return m.is_terminated()
