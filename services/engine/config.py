"""Engine arguments, as users of vLLM know them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class EngineArgs:
    block_size: int = 16
    num_kv_blocks: int | None = None  # override the automatic sizing (tests)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16
    device: str = "cpu"
    attention_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere), torch, triton
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: int = 1 << 30
    cpu_kv_cache_fraction: float = 0.25
    cpu_kv_cache_max_bytes: int = 2 << 30
    enable_cuda_graphs: bool = True
    # Defaults for a request's unset sampling fields: "auto" takes the model directory's
    # generation_config.json (as vLLM does), "vllm" (or "none") the built-in ones, or a directory
    # holding a generation_config.json.
    generation_config: str = "auto"
    seed: int = 0
    num_threads: int = 0  # torch intra-op threads on CPU (0: torch's default, one per core)
    # Test-only: sleep this long in every step, to make a slow runtime on purpose.
    debug_step_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)
