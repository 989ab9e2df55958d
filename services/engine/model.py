"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3: GQA, RoPE, RMSNorm, SwiGLU) over the paged
cache.

Weights are read tensor by tensor from the checkpoint (services.engine.checkpoint) straight into
the engine's dtype, with q/k/v and gate/up fused, so a layer is four matmuls. The forward pass
takes a flat batch of tokens from many sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels
from kernels.cpu.decode_layers import DecodeLayer, DecodeLayers
from kernels.reference import compute_cos_sin_cache
from services.engine.attention import AttentionMetadata
from services.engine.checkpoint import Checkpoint
from services.engine.linear import Linear, row_bucket
from services.engine.model_config import ModelConfig

# Per-layer linear layers and norm weights, as LlamaLayer names them.
LAYER_LINEARS = ("qkv", "o", "gate_up", "down")
LAYER_NORMS = ("input_norm", "post_norm", "q_norm", "k_norm")


def dense_linear(ckpt: Checkpoint, modules: list[str], dtype: torch.dtype, device: torch.device,
                 bias: bool = False, swiglu: bool = False) -> Linear:
    """The projection of checkpoint modules (fused along the output dimension) in the model's
    dtype; swiglu: the modules are [gate, up], and the layout may fuse the activation (Linear).
    A quantized model loads its projections through another function of this signature
    (services.engine.quantization.loader)."""
    return Linear(ckpt.fused([f"{m}.weight" for m in modules], dtype, device),
                  ckpt.fused([f"{m}.bias" for m in modules], dtype, device) if bias else None, swiglu=swiglu)


class LlamaLayer:
    def __init__(self, ckpt: Checkpoint, prefix: str, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, load_linear=dense_linear):
        a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
        proj = [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]
        self.qkv = load_linear(ckpt, proj, dtype, device, bias=config.attention_bias)
        self.o = load_linear(ckpt, [f"{a}.o_proj"], dtype, device)
        self.gate_up = load_linear(ckpt, [f"{m}.gate_proj", f"{m}.up_proj"], dtype, device, swiglu=True)
        self.down = load_linear(ckpt, [f"{m}.down_proj"], dtype, device)
        self.input_norm = ckpt.get(f"{prefix}.input_layernorm.weight", dtype, device)
        self.post_norm = ckpt.get(f"{prefix}.post_attention_layernorm.weight", dtype, device)
        self.q_norm = ckpt.get(f"{a}.q_norm.weight", dtype, device) if config.qk_norm else None
        self.k_norm = ckpt.get(f"{a}.k_norm.weight", dtype, device) if config.qk_norm else None

    def mlp(self, x: torch.Tensor, ops) -> torch.Tensor:
        """down(silu(gate) * up), the activation fused into the gate/up product where its kernel
        can (a LoRA or quantized gate_up runs the product, then the element-wise op)."""
        gate_up = self.gate_up
        if isinstance(gate_up, Linear) and gate_up.fuses_swiglu:
            return self.down(gate_up.swiglu(x))
        return self.down(ops.silu_and_mul(gate_up(x)))


class LlamaModel:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, ops, load_linear=dense_linear):
        self.config, self.dtype, self.device, self.ops = config, dtype, device, ops
        ckpt = Checkpoint(config.path)
        self.embed = ckpt.get("model.embed_tokens.weight", dtype, device)
        # Tied embeddings: the lookup reads the plain table, the logits a packed copy of it.
        tied = config.tie_word_embeddings or not (ckpt.has("lm_head.weight") or ckpt.has("lm_head.weight_packed"))
        self.lm_head = Linear(self.embed) if tied else load_linear(ckpt, ["lm_head"], dtype, device)
        self.norm = ckpt.get("model.norm.weight", dtype, device)
        self.layers = [LlamaLayer(ckpt, f"model.layers.{i}", config, dtype, device, load_linear)
                       for i in range(config.num_layers)]
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.rope = compute_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                          c.rope_scaling).to(device)
        self.attn = ops.attention_cls(c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5)
        # oneDNN's packed matmuls run at bucketed row counts (linear.row_bucket): the step's rows are
        # padded once at the embedding, and attention writes its real rows into a padded buffer.
        self.pads_rows = all(isinstance(lin, Linear) and lin.wants_row_buckets for lin in self._linear_shapes())
        self.decode_layers: DecodeLayers | None = None  # fuse_decode: decode steps in one C call
        self._fusable_rows: dict[int, bool] = {}

    def _linear_shapes(self) -> list:
        """One linear of each shape (oneDNN's primitives are per shape, not per weight)."""
        return [self.lm_head] + [getattr(self.layers[0], n) for n in LAYER_LINEARS]

    def rows_for(self, rows: int) -> int:
        """The rows a forward or logits call of `rows` rows computes (padded ones included)."""
        return row_bucket(rows) if self.pads_rows else rows

    def warm_up(self, max_tokens: int, max_logit_rows: int) -> None:
        """Builds, at load, the matmul primitives of every row bucket a step can meet (up to
        max_tokens rows; the logits up to max_logit_rows), rather than in the first steps that
        meet them (bench/row_buckets.py: a new server's first batch)."""
        if not self.pads_rows:
            return
        with torch.inference_mode():
            for lin in self._linear_shapes():
                limit = max_logit_rows if lin is self.lm_head else max_tokens
                for rows in sorted({row_bucket(r) for r in range(1, limit + 1)}):
                    lin(torch.zeros(rows, lin.in_features, dtype=self.dtype, device=self.device))

    def fuse_decode(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Runs decode-only steps through every layer in one C call from now on (kernels/cpu/
        decode_layers.c: the same kernels on the same buffers, without a Python wrapper per op),
        where this model can: on CPU with the torch ops, fp32 or bf16, every projection a plain
        blocked Linear (no LoRA or quantized layers), caches of the model's dtype. Call it once
        the layers are final. Returns whether it does."""
        linears = [getattr(layer, n) for layer in self.layers for n in LAYER_LINEARS]
        if not (self.device.type == "cpu" and self.ops.name == "torch" and self.dtype in cpu_kernels.KERNEL_DTYPES
                and cpu_kernels.load() is not None and self.layers
                and all(isinstance(lin, Linear) and lin.blocked_for(1) is not None for lin in linears)
                and all(isinstance(c, torch.Tensor) and c.dtype == self.dtype for pair in kv_caches for c in pair)):
            return False
        c = self.config
        self.decode_layers = DecodeLayers(
            [DecodeLayer(layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.qkv.blocked_for(1),
                         layer.o.blocked_for(1), layer.gate_up.blocked_for(1), layer.down.blocked_for(1), k, v)
             for layer, (k, v) in zip(self.layers, kv_caches)],
            c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.head_dim ** -0.5, self.rope, self.dtype)
        self._fusable_rows.clear()
        return True

    def _fuses(self, meta: AttentionMetadata, rows: int) -> bool:
        """This step runs fused: decode tokens only, each projection on its blocked weight at this
        many rows (an fp32 weight also held for oneDNN leaves bigger calls to it)."""
        if self.decode_layers is None or meta.num_prefill_tokens or not rows:
            return False
        if (fuses := self._fusable_rows.get(rows)) is None:
            fuses = self._fusable_rows[rows] = all(getattr(layer, n).blocked_for(rows) is not None
                                                   for layer in self.layers for n in LAYER_LINEARS)
        return fuses

    def weight_bytes(self) -> int:
        """Bytes of every weight as held (packed layouts included; a tied lm_head that shares
        the embedding's storage counted once)."""
        linears = [self.lm_head] + [getattr(layer, n) for layer in self.layers for n in LAYER_LINEARS]
        norms = [self.embed, self.norm] + [getattr(layer, n) for layer in self.layers for n in LAYER_NORMS]
        shared = self.lm_head.weight is self.embed
        return (sum(lin.nbytes for lin in linears) - (self.embed.numel() * self.embed.element_size() if shared else 0)
                + sum(t.numel() * t.element_size() for t in norms if t is not None))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        ops, c = self.ops, self.config
        eps = c.rms_norm_eps
        n = input_ids.shape[0]
        if self._fuses(meta, n):
            h, residual = self.decode_layers(self.embed.index_select(0, input_ids), positions, meta.slot_mapping,
                                             meta.decode_block_tables, meta.decode_context_lens)
            return ops.rms_norm(h, self.norm, eps, residual)[0]
        rows = self.rows_for(n)
        attn_out = None
        if rows > n:  # padded rows: token 0 at position 0, never stored in the cache nor attended
            input_ids, positions = F.pad(input_ids, (0, rows - n)), F.pad(positions, (0, rows - n))
            attn_out = torch.zeros(rows, c.num_heads, c.head_dim, dtype=self.dtype, device=self.device)
        h = self.embed.index_select(0, input_ids)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = h, ops.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = ops.rms_norm(h, layer.input_norm, eps, residual)
            qkv = layer.qkv(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(rows, c.num_heads, c.head_dim)
            k = k.reshape(rows, c.num_kv_heads, c.head_dim)
            v = v.reshape(rows, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
                q = ops.rms_norm(q, layer.q_norm, eps)
                k = ops.rms_norm(k, layer.k_norm, eps)
            q, k = ops.rotary(positions, q, k, self.rope, c.head_dim)
            if attn_out is None:
                o = self.attn.forward(q, k, v, k_cache, v_cache, meta)
            else:
                o = attn_out
                self.attn.forward(q[:n], k[:n], v[:n], k_cache, v_cache, meta, out=attn_out[:n])
            h = layer.o(o.view(rows, self.q_size))
            x, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            h = layer.mlp(x, ops)
        h, _ = ops.rms_norm(h, self.norm, eps, residual)
        return h[:n]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in the model's dtype: the sampler converts what it needs to fp32."""
        n = hidden.shape[0]
        rows = self.rows_for(n)
        if rows > n:
            return self.lm_head(F.pad(hidden, (0, 0, 0, rows - n)))[:n]
        return self.lm_head(hidden)
