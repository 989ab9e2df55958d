"""Strata engine: the runtime layer (one model on one device).

    from services.engine import LLM, SamplingParams
    llm = LLM(model_dir, block_size=16, max_num_seqs=64)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

import importlib

# Imported on first use (PEP 562), so that the control plane and the scaler read the engine's
# arguments (services.engine.config, .launch) without loading torch and the runtime.
_EXPORTS = {"EngineArgs": "config", "LLM": "llm", "LLMEngine": "llm_engine", "LoRARequest": "lora",
            "CompletionOutput": "outputs", "RequestOutput": "outputs", "InvalidRequestError": "sampling_params",
            "SamplingParams": "sampling_params"}

__all__ = ["LLM", "LLMEngine", "LoRARequest", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "InvalidRequestError"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
