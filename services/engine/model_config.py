"""What the engine needs from a Hugging Face model directory's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


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
            raise ValueError(f"{path}: architecture {archs} not supported "
                             f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})")
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
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            for t in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
                if t is not None and t not in eos_ids:
                    eos_ids.append(t)
        heads = cfg["num_attention_heads"]
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
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )
