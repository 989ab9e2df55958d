"""Speculative decoding: n-gram (prompt lookup) and draft-model proposals, verified exactly by the
target in the same forward as the rest of the batch, with the number of drafts per step chosen
by a measured cost model. See decoder.py for how it hooks into the engine."""

from services.engine.spec_decode.config import SpeculativeConfig
from services.engine.spec_decode.decoder import SpecDecodeStats, SpeculativeDecoder

__all__ = ["SpecDecodeStats", "SpeculativeConfig", "SpeculativeDecoder"]
