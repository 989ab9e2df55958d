"""The limits a request is checked against: those the model's replicas advertise.

An engine's effective max_model_len can be smaller than its checkpoint's config.json says (an
engine argument), so the gateway checks a request's prompt + max_tokens and its token ids
against what the replicas of its model say in their heartbeats (Heartbeat.max_model_len and
vocab_size; 0: not said). Any of them may get the request, so the tightest of those heard
lately counts; while no replica has said (none heard yet, or an older engine), config.json's.
Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Heartbeat

ADVERTISED_FOR_S = 10.0  # a replica not heard from for this long no longer counts (it is gone)


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


class AdvertisedLimits:
    def __init__(self, fresh_s: float = ADVERTISED_FOR_S):
        self.fresh_s = fresh_s
        self._replicas: dict[str, tuple[str, int, int, float]] = {}  # replica -> (model, max_model_len, vocab, seen)

    def note(self, hb: Heartbeat, now: float) -> None:
        if hb.max_model_len > 0 or hb.vocab_size > 0:
            self._replicas[hb.replica_id] = (hb.model, hb.max_model_len, hb.vocab_size, now)
        else:
            self._replicas.pop(hb.replica_id, None)

    def of(self, model: str, fallback: ModelLimits, now: float) -> ModelLimits:
        """The model's limits: the tightest its replicas advertised lately, each limit falling
        back to `fallback` (config.json) while none has said it."""
        lens, vocabs = [], []
        for replica_id, (name, max_model_len, vocab_size, seen) in list(self._replicas.items()):
            if now - seen > self.fresh_s:
                del self._replicas[replica_id]
                continue
            if name == model:
                if max_model_len > 0:
                    lens.append(max_model_len)
                if vocab_size > 0:
                    vocabs.append(vocab_size)
        return ModelLimits(min(lens) if lens else fallback.max_model_len,
                           min(vocabs) if vocabs else fallback.vocab_size)
