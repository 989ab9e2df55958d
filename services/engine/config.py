"""Engine arguments, as users of vLLM know them: the one definition that the engine's flags,
the deployment spec's `engine` section and the scaler's engine command lines are made from."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from services.engine.quantization import support as quantization_support


def arg(default: Any, help: str, *, key: str | None = None, spec: bool = True, check=None) -> Any:
    """A field of EngineArgs. `key`: its name in a deployment spec and as a flag (--key with
    dashes) when that differs from the field's name; `spec=False`: not settable per deployment;
    `check(value)`: raises ValueError for a value of the right type that is still wrong (also
    run on deployment specs)."""
    return field(default=default, metadata={"help": help, "key": key, "spec": spec, "check": check})


def _check_speculative_config(value: dict, check_model_dir: bool = True) -> None:
    from services.engine.spec_decode.config import SpeculativeConfig

    SpeculativeConfig.from_dict(value, check_model_dir)


ENGINE_CORES = ("thread", "process")


def _check_engine_core(value: str) -> None:
    if value not in ENGINE_CORES:
        raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, got {value!r}")


@dataclass
class EngineArgs:
    block_size: int = arg(16, "tokens per KV-cache block (a power of two)")
    num_kv_blocks: int | None = arg(None, "KV-cache blocks (default: sized from the device's memory)")
    max_num_seqs: int = arg(64, "sequences in one batch at most")
    max_num_batched_tokens: int = arg(2048, "tokens in one step at most (prefill chunks included)")
    max_model_len: int | None = arg(None, "context length (default: the model's max_position_embeddings)")
    enable_prefix_caching: bool = arg(True, "reuse cached KV blocks across requests with a shared prefix")
    dtype: str = arg("auto", "auto (the checkpoint's dtype where the device runs it natively), float32, "
                             "float16, bfloat16")
    quantization: str | None = arg(None, "weights the kernels read packed: int8 (per output channel), int4 "
                                         "(groups of 128), fp8 (GPU only); default: the checkpoint's "
                                         "quantization_config (compressed-tensors), else none")
    kv_cache_dtype: str = arg("auto", "auto (the model's dtype), int8 (CPU) or fp8 (GPU), with a scale per "
                                      "token and KV head")
    device: str = arg("cpu", "cpu, cuda or cuda:N")
    attention_backend: str = arg("auto", "auto (triton on CUDA, torch elsewhere), torch, triton")
    gpu_memory_utilization: float = arg(0.9, "share of the GPU's free memory the engine may take")
    activation_reserve_bytes: int = arg(1 << 30, "GPU memory kept free for activations", spec=False)
    cpu_kv_cache_fraction: float = arg(0.25, "share of available RAM for the KV cache on CPU", spec=False)
    cpu_kv_cache_max_bytes: int = arg(2 << 30, "KV cache bytes on CPU at most", spec=False)
    enable_cuda_graphs: bool = arg(True, "replay decode steps from CUDA graphs")
    generation_config: str = arg("auto", "defaults for a request's unset sampling fields: auto (the model's "
                                         "generation_config.json, as vLLM), vllm (built-in defaults), or a "
                                         "directory holding a generation_config.json")
    seed: int = arg(0, "seed of the sampler's generator for unseeded requests")
    num_threads: int = arg(0, "torch threads for the model on CPU (0: torch's default, one per core)",
                           key="threads")
    enable_lora: bool = arg(False, "serve LoRA adapters beside the base model (one batch may mix adapters)")
    max_loras: int = arg(1, "LoRA adapters resident on the device at once (so in one batch at most)")
    max_lora_rank: int = arg(16, "highest LoRA rank an adapter may have (device slots are sized for it)")
    max_cpu_loras: int | None = arg(None, "LoRA adapters kept in host memory (default: max_loras)")
    debug_step_delay_s: float = arg(0.0, "test only: sleep this long in every step (a slow runtime on purpose)",
                                    key="debug_step_delay")
    speculative_config: dict | None = arg(
        None, 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", "model": DIR, '
              '"num_speculative_tokens": 4}; "adaptive": false keeps k fixed', check=_check_speculative_config)
    engine_core: str = arg("process", "where the step loop runs: thread (a thread of the worker process) or process "
                                     "(an engine core process of its own, as vLLM v1; the worker keeps NATS and "
                                     "tokenization)", check=_check_engine_core)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_engine_core(self.engine_core)
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        errors = quantization_support.check(self.quantization, self.kv_cache_dtype, self.device)
        if errors:
            raise ValueError("; ".join(f"{name}: {reason}" for name, reason in errors))
        if self.speculative_config is not None:
            _check_speculative_config(self.speculative_config)
            if self.enable_lora:  # drafts and verification know nothing of adapters yet
                raise ValueError("speculative_config: not supported together with enable_lora")
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_loras must be >= 1 and max_lora_rank in [1, 512], got {self.max_loras}, "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def speculative(self):
        """speculative_config parsed (spec_decode.SpeculativeConfig), or None."""
        if self.speculative_config is None:
            return None
        from services.engine.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.from_dict(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)

    # ---- the generated interfaces -----------------------------------------------------------
    @classmethod
    def spec_args(cls) -> dict[str, type]:
        """Deployment-spec key -> type of every argument a deployment may set."""
        return {_key(f): _base_type(f) for f in dataclasses.fields(cls) if f.metadata["spec"]}

    @classmethod
    def spec_value_error(cls, key: str, value: Any) -> str | None:
        """Why a deployment spec's value (of the right type) for `key` is refused, or None."""
        f = next((f for f in dataclasses.fields(cls) if _key(f) == key), None)
        check = f.metadata["check"] if f is not None else None
        if check is None:
            return None
        try:
            if check is _check_speculative_config:  # the draft model's files are on the engine's machine
                check(value, check_model_dir=False)
            else:
                check(value)
        except ValueError as exc:
            return str(exc)
        return None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            flag = "--" + _key(f).replace("_", "-")
            kind = _base_type(f)
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                   help=f.metadata["help"])
            elif kind is dict:
                group.add_argument(flag, dest=f.name, type=_json_object, default=f.default, help=f.metadata["help"])
            else:
                group.add_argument(flag, dest=f.name, type=kind, default=f.default, help=f.metadata["help"])
        # Older spelling, kept for existing command lines.
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                           help=argparse.SUPPRESS)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def cli_flags(cls, spec_engine: dict[str, Any]) -> list[str]:
        """The flags that give an engine process a deployment spec's engine arguments."""
        fields = {_key(f): f for f in dataclasses.fields(cls)}
        flags: list[str] = []
        for key, value in spec_engine.items():
            f = fields.get(key)
            if f is None:
                raise ValueError(f"unknown engine argument {key!r}")
            flag = "--" + key.replace("_", "-")
            if _base_type(f) is bool:
                flags.append(flag if value else "--no-" + flag[2:])
            elif _base_type(f) is dict:
                flags += [flag, json.dumps(value)]
            else:
                flags += [flag, str(value)]
        return flags


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _key(f: dataclasses.Field) -> str:
    return f.metadata["key"] or f.name


def _base_type(f: dataclasses.Field) -> type:
    """int for `int | None`, and so on (fields' annotations are strings here)."""
    hint = typing.get_type_hints(EngineArgs)[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
