"""Llama-family decoder (Llama, Qwen2, Mistral: GQA, RoPE, RMSNorm, SwiGLU) over the paged cache.

Weights are loaded from the model directory's safetensors with q/k/v and gate/up fused, so a
layer is four matmuls. The forward pass takes a flat batch of tokens from many sequences.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.attention import AttentionMetadata
from kernels.reference import compute_cos_sin_cache
from services.engine.model_config import ModelConfig


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


class LlamaLayer:
    def __init__(self, w: dict[str, torch.Tensor], prefix: str, bias: bool):
        a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.qkv = torch.cat([w[f"{a}.q_proj.weight"], w[f"{a}.k_proj.weight"], w[f"{a}.v_proj.weight"]])
        self.qkv_bias = (torch.cat([w[f"{a}.q_proj.bias"], w[f"{a}.k_proj.bias"], w[f"{a}.v_proj.bias"]])
                         if bias else None)
        self.o = w[f"{a}.o_proj.weight"]
        self.gate_up = torch.cat([w[f"{m}.gate_proj.weight"], w[f"{m}.up_proj.weight"]])
        self.down = w[f"{m}.down_proj.weight"]
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_norm = w[f"{prefix}.post_attention_layernorm.weight"]

    def tensors(self) -> list[str]:
        return ["qkv", "qkv_bias", "o", "gate_up", "down", "input_norm", "post_norm"]


class LlamaModel:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, ops):
        self.config, self.dtype, self.device, self.ops = config, dtype, device, ops
        w = _load_tensors(config.path)
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w.get("lm_head.weight", self.embed)
        self.norm = w["model.norm.weight"]
        self.layers = [LlamaLayer(w, f"model.layers.{i}", config.attention_bias) for i in range(config.num_layers)]
        del w
        self._to(dtype, device)
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.rope = compute_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                          c.rope_scaling).to(device)
        self.attn = ops.attention_cls(c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5)

    def _to(self, dtype: torch.dtype, device: torch.device) -> None:
        def conv(t):
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        tied = self.lm_head is self.embed
        self.embed, self.norm = conv(self.embed), conv(self.norm)
        self.lm_head = self.embed if tied else conv(self.lm_head)
        for layer in self.layers:
            for name in layer.tensors():
                setattr(layer, name, conv(getattr(layer, name)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        ops, c = self.ops, self.config
        eps = c.rms_norm_eps
        n = input_ids.shape[0]
        h = self.embed.index_select(0, input_ids)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = h, ops.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = ops.rms_norm(h, layer.input_norm, eps, residual)
            qkv = torch.nn.functional.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, c.num_heads, c.head_dim)
            k = k.view(n, c.num_kv_heads, c.head_dim)
            v = v.reshape(n, c.num_kv_heads, c.head_dim)
            q, k = ops.rotary(positions, q, k, self.rope, c.head_dim)
            o = self.attn.forward(q, k, v, k_cache, v_cache, meta)
            h = torch.nn.functional.linear(o.view(n, self.q_size), layer.o)
            x, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            h = torch.nn.functional.linear(ops.silu_and_mul(torch.nn.functional.linear(x, layer.gate_up)), layer.down)
        h, _ = ops.rms_norm(h, self.norm, eps, residual)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.lm_head).float()
