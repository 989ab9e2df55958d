"""Strata's Triton kernels and their plain-torch references.

Every kernel runs on CUDA tensors (compiled Triton) and, when TRITON_INTERPRET=1
was set before triton was first imported, on CPU tensors through the Triton
interpreter. See each module for the exact contracts; the KV-cache layout is
documented in :mod:`kernels.attention`.

The names below are resolved lazily (PEP 562), so importing the package, or a
sibling such as ``kernels.cpu``, does not import triton: triton fixes at import
time whether it interprets, and only code that uses a Triton kernel should decide.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "store_kv_cache": ".attention",
    "paged_decode_attention": ".attention",
    "paged_prefill_attention": ".attention",
    "choose_num_splits": ".attention",
    "rms_norm": ".norm",
    "rotary_embedding": ".rotary",
    "silu_and_mul": ".activation",
    "bgmv_shrink": ".lora",
    "bgmv_expand": ".lora",
    "lora_delta_ref": ".lora",
    "compute_cos_sin_cache": ".reference",
    "store_kv_cache_ref": ".reference",
    "paged_decode_attention_ref": ".reference",
    "paged_prefill_attention_ref": ".reference",
    "rms_norm_ref": ".reference",
    "rotary_embedding_ref": ".reference",
    "silu_and_mul_ref": ".reference",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
