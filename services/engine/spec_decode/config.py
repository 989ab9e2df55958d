"""The `speculative_config` engine argument, in vLLM's shape:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}

plus one key of Strata's: "adaptive" (default true): choose k per step from the measured cost
model (services.engine.spec_decode.adaptive), down to no speculation; false: always k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive"},
    "draft_model": {"method", "model", "num_speculative_tokens", "adaptive"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    model: str | None = None
    adaptive: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any], check_model_dir: bool = True) -> "SpeculativeConfig":
        """Validate a speculative_config mapping; ValueError naming the key that is wrong.
        check_model_dir=False: leave the draft model's directory unchecked (a deployment spec is
        validated where the engine's files are not)."""
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(raw).__name__}")
        method = raw.get("method", "draft_model" if "model" in raw else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        unknown = sorted(set(raw) - _KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) for method {method!r}: {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(_KEYS[method]))})")

        def integer(key: str, low: int, high: int, default: int | None = None) -> int:
            value = raw.get(key, default)
            if value is None:
                raise ValueError(f"speculative_config.{key} is required for method {method!r}")
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative_config.{key} must be an integer in [{low}, {high}], got {value!r}")
            return value

        k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        if method == "ngram":
            # vLLM's defaults: prompt_lookup_min falls back to max, and max to min (or 5 without either).
            lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
            hi = integer("prompt_lookup_max", 1, 64, hi if hi is not None else (lo if lo is not None else 5))
            lo = integer("prompt_lookup_min", 1, 64, lo if lo is not None else hi)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed "
                                 f"prompt_lookup_max ({hi})")
            return cls(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi, adaptive=adaptive)
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model (the draft model's directory) is required for draft_model")
        if check_model_dir and not (Path(model) / "config.json").is_file():
            raise ValueError(f"speculative_config.model: no model directory at {model!r} (config.json missing)")
        return cls(method, k, model=model, adaptive=adaptive)
