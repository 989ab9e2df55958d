"""Engine arguments, as users of vLLM know them: the one definition that the engine's flags,
the deployment spec's `engine` section and the scaler's engine command lines are made from."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from services.engine.quantization import support as quantization_support


def arg(default: Any, help: str, *, key: str | None = None, spec: bool = True, check=None) -> Any:
    """A field of EngineArgs. `key`: its name in a deployment spec and as a flag (--key with
    dashes) when that differs from the field's name; `spec=False`: not settable per deployment;
    `check(value, on_engine)`: raises ValueError for a value of the right type that is still
    wrong (also run on deployment specs, where on_engine is False: the engine's files are not
    there)."""
    return field(default=default, metadata={"help": help, "key": key, "spec": spec, "check": check})


def _check_speculative_config(value: dict, on_engine: bool = True) -> None:
    from services.engine.spec_decode.config import SpeculativeConfig

    SpeculativeConfig.from_dict(value, check_model_dir=on_engine)


class EngineArgsError(ValueError):
    """Engine arguments that cannot run; `problems` lists (field name, reason) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{name}: {reason}" for name, reason in problems))


ENGINE_CORES = ("thread", "process")


def _check_engine_core(value: str, _on_engine: bool = True) -> None:
    if value not in ENGINE_CORES:
        raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, got {value!r}")


SAMPLER_BACKENDS = ("auto", "torch", "triton")


def _check_sampler_backend(value: str, on_engine: bool = True) -> None:
    if value not in SAMPLER_BACKENDS:
        raise ValueError(f"sampler_backend must be one of {', '.join(SAMPLER_BACKENDS)}, got {value!r}")


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
    sampler_backend: str = arg("auto", "the sampler's vocabulary-wide steps: auto (C kernels on CPU, Triton kernels "
                                       "on CUDA), torch (torch ops everywhere), triton (Triton kernels; on CPU "
                                       "only under TRITON_INTERPRET=1)", check=_check_sampler_backend)
    gpu_memory_utilization: float = arg(0.9, "share of the GPU's free memory the engine may take")
    activation_reserve_bytes: int = arg(1 << 30, "GPU memory kept free for activations", spec=False)
    cpu_kv_cache_fraction: float = arg(0.25, "share of available RAM for the KV cache on CPU", spec=False)
    cpu_kv_cache_max_bytes: int = arg(2 << 30, "KV cache bytes on CPU at most", spec=False)
    enable_cuda_graphs: bool = arg(True, "replay decode steps from CUDA graphs")
    fuse_cpu_decode: bool = arg(True, "on CPU, run a decode step's layers in one C call (kernels/cpu/decode_layers.c) "
                                      "rather than op by op")
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
        problems = _problems({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, type(self),
                             on_engine=True)
        if problems:
            raise EngineArgsError(problems)

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

    # ---- the generated interfaces: every one is made from schema() -------------------------
    @classmethod
    def schema(cls) -> tuple["ArgSpec", ...]:
        """How each field appears outside Python: its spec key, flag and type."""
        return _schema(cls)

    @classmethod
    def spec_args(cls) -> dict[str, type]:
        """Deployment-spec key -> type of every argument a deployment may set."""
        return {a.key: a.kind for a in cls.schema() if a.spec}

    @classmethod
    def spec_problems(cls, engine: dict[str, Any]) -> list[tuple[str, str]]:
        """(spec key, reason) for each way a deployment spec's engine arguments, each known and
        of the right type, cannot run: a field's own check and the checks across fields, as the
        engine makes them at start (less what needs the engine's files)."""
        by_key = {a.key: a for a in cls.schema()}
        values = {a.name: a.default for a in cls.schema()}
        values.update({by_key[key].name: value for key, value in engine.items()})
        key_of = {a.name: a.key for a in cls.schema()}
        return [(key_of.get(name, name), reason) for name, reason in _problems(values, cls, on_engine=False)]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        for a in cls.schema():
            a.add_flag(group)
        # Older spelling, kept for existing command lines.
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                           help=argparse.SUPPRESS)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        return cls(**{a.name: getattr(namespace, a.name) for a in cls.schema()})

    @classmethod
    def cli_flags(cls, spec_engine: dict[str, Any]) -> list[str]:
        """The flags that give an engine process a deployment spec's engine arguments."""
        by_key = {a.key: a for a in cls.schema()}
        flags: list[str] = []
        for key, value in spec_engine.items():
            a = by_key.get(key)
            if a is None:
                raise ValueError(f"unknown engine argument {key!r}")
            flags += a.flags(value)
        return flags


@dataclass(frozen=True)
class ArgSpec:
    """One engine argument as the world outside Python names it: `key` in a deployment spec,
    `flag` on the engine's command line."""

    name: str
    key: str
    kind: type  # int for `int | None`, and so on
    default: Any
    help: str
    spec: bool
    check: Any

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def add_flag(self, group) -> None:
        if self.kind is bool:
            group.add_argument(self.flag, dest=self.name, action=argparse.BooleanOptionalAction, default=self.default,
                               help=self.help)
        else:
            group.add_argument(self.flag, dest=self.name, type=_json_object if self.kind is dict else self.kind,
                               default=self.default, help=self.help)

    def flags(self, value: Any) -> list[str]:
        """The flags that set this argument to `value` (the inverse of add_flag)."""
        if self.kind is bool:
            return [self.flag if value else "--no-" + self.flag[2:]]
        return [self.flag, json.dumps(value) if self.kind is dict else str(value)]


@functools.cache
def _schema(cls: type) -> tuple[ArgSpec, ...]:
    hints = typing.get_type_hints(cls)  # the annotations are strings here
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        out.append(ArgSpec(f.name, f.metadata["key"] or f.name, kind, f.default, f.metadata["help"], f.metadata["spec"],
                           f.metadata["check"]))
    return tuple(out)


def _problems(values: dict[str, Any], cls: type, on_engine: bool) -> list[tuple[str, str]]:
    """(field name, reason) for each way these argument values cannot run. `on_engine`: checked
    where the engine runs (its files are there), not on the control plane."""
    out: list[tuple[str, str]] = []
    for a in _schema(cls):
        if a.check is not None and values[a.name] is not None:
            try:
                a.check(values[a.name], on_engine)
            except ValueError as exc:
                out.append((a.name, str(exc)))
    block_size = values["block_size"]
    if block_size < 1 or block_size & (block_size - 1):
        out.append(("block_size", f"must be a power of two, got {block_size}"))
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if values[name] < 1:
            out.append((name, "must be >= 1"))
    out += quantization_support.check(values["quantization"], values["kv_cache_dtype"], values["device"])
    if (on_engine and values["sampler_backend"] == "triton" and not values["device"].startswith("cuda")
            and os.environ.get("TRITON_INTERPRET") != "1"):
        out.append(("sampler_backend", "triton needs a CUDA device (or TRITON_INTERPRET=1, the interpreter)"))
    if values["speculative_config"] is not None and values["enable_lora"]:
        # Drafts and verification know nothing of adapters yet.
        out.append(("speculative_config", "not supported together with enable_lora"))
    max_loras, max_lora_rank = values["max_loras"], values["max_lora_rank"]
    if max_loras < 1 or not 1 <= max_lora_rank <= 512:
        out.append(("max_loras", f"must be >= 1 and max_lora_rank in [1, 512], got {max_loras}, {max_lora_rank}"))
    if values["max_cpu_loras"] is not None and values["max_cpu_loras"] < max_loras:
        out.append(("max_cpu_loras", f"({values['max_cpu_loras']}) must be >= max_loras ({max_loras})"))
    return out


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
