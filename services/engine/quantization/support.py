"""Which quantizations exist and which device runs which: the one table that the engine's
arguments, the engine at load and the control plane's deployment spec all check against.

Pure (no torch, no I/O), so the control plane validates a spec without loading the runtime.
"""

from __future__ import annotations

# engine argument `quantization` (vLLM's name): weight formats the kernels read packed.
WEIGHT_QUANTIZATIONS: dict[str, str] = {
    "int8": "weight-only int8, one scale per output channel (W8A16 in bf16, W8A32 in fp32)",
    "int4": "weight-only int4, one scale per group of 128 input channels, two values per byte",
    "fp8": "fp8 e4m3 weights, one scale per output channel (GPU only)",
}
# engine argument `kv_cache_dtype` (vLLM's name).
KV_CACHE_DTYPES: dict[str, str] = {
    "auto": "the model's dtype",
    "int8": "int8 with a scale per token and KV head (CPU)",
    "fp8": "fp8 e4m3 with a scale per token and KV head (GPU)",
}
# What each device type runs.
DEVICE_SUPPORT: dict[str, dict[str, tuple[str, ...]]] = {
    "cpu": {"quantization": ("int8", "int4"), "kv_cache_dtype": ("auto", "int8")},
    "cuda": {"quantization": ("int8", "int4", "fp8"), "kv_cache_dtype": ("auto", "fp8")},
}
NOT_QUANTIZED = "none"  # what a replica running full-precision weights reports


def device_type(device: str) -> str:
    """"cuda" for "cuda:1", and so on."""
    return str(device).split(":", 1)[0]


def check(quantization: str | None, kv_cache_dtype: str, device: str) -> list[tuple[str, str]]:
    """(field, reason) for every value the device cannot run; empty when all is well."""
    errors: list[tuple[str, str]] = []
    kind = device_type(device)
    supported = DEVICE_SUPPORT.get(kind)
    if quantization is not None and quantization not in WEIGHT_QUANTIZATIONS:
        errors.append(("quantization", f"unknown quantization {quantization!r} "
                                       f"(known: {', '.join(WEIGHT_QUANTIZATIONS)})"))
    elif quantization is not None and supported is not None and quantization not in supported["quantization"]:
        errors.append(("quantization", _unsupported(quantization, kind, "quantization")))
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        errors.append(("kv_cache_dtype", f"unknown KV-cache dtype {kv_cache_dtype!r} "
                                         f"(known: {', '.join(KV_CACHE_DTYPES)})"))
    elif supported is not None and kv_cache_dtype not in supported["kv_cache_dtype"]:
        errors.append(("kv_cache_dtype", _unsupported(kv_cache_dtype, kind, "kv_cache_dtype")))
    return errors


def _unsupported(value: str, kind: str, field: str) -> str:
    where = [d for d, s in DEVICE_SUPPORT.items() if value in s[field]]
    return (f"{value} is not supported on {kind}; it runs on {' and '.join(where)} only "
            f"({kind} runs {', '.join(DEVICE_SUPPORT[kind][field])})")
