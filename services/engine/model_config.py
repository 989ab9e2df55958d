"""What the engine needs from a Hugging Face model directory's config.json (and
generation_config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.engine.sampling_params import BUILTIN_DEFAULTS

# Llama-family decoders: GQA, RoPE, RMSNorm, SwiGLU. Qwen2 adds q/k/v biases, Qwen3 a per-head
# RMSNorm on q and k before RoPE.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# generation_config.json keys that fill a request's unset sampling fields (as vLLM reads them).
GENERATION_DEFAULT_KEYS = tuple(BUILTIN_DEFAULTS)


@dataclass
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None = None  # when the model attends to a window only
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str = "float32"

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        config_file = path / "config.json"
        if not config_file.exists():
            raise ValueError(f"{path}: no config.json (not a Hugging Face model directory)")
        cfg = json.loads(config_file.read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{path}: architecture {archs or cfg.get('model_type')!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        # transformers >= 5 writes rope settings as rope_parameters; older configs use
        # rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        gen_eos = _generation_config(path).get("eos_token_id")
        for t in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if t is not None and t not in eos_ids:
                eos_ids.append(t)
        heads = cfg["num_attention_heads"]
        qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        # Mistral attends to a window whenever one is set; Qwen only when use_sliding_window says so.
        window = cfg.get("sliding_window") if (not qwen or cfg.get("use_sliding_window")) else None
        return cls(
            path=path,
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 has q/k/v biases without saying so in its config; Qwen3 has none.
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )

    def generation_defaults(self, source: str = "auto") -> dict[str, float | int]:
        """Sampling defaults for unset request fields: "auto" reads the model directory's
        generation_config.json, "vllm" or "none" uses none (the built-in defaults apply), any
        other value is a directory holding a generation_config.json."""
        if source in ("vllm", "none"):
            return {}
        folder = self.path if source == "auto" else Path(source)
        if source != "auto" and not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config: {folder} has no generation_config.json "
                             f"(or use 'auto' or 'vllm')")
        gen = _generation_config(folder)
        return {k: gen[k] for k in GENERATION_DEFAULT_KEYS if isinstance(gen.get(k), (int, float))
                and not isinstance(gen.get(k), bool)}


def _generation_config(folder: Path) -> dict:
    gen_file = folder / "generation_config.json"
    return json.loads(gen_file.read_text()) if gen_file.exists() else {}
