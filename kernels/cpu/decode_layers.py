"""A decode step through every decoder layer in one C call (kernels/cpu/decode_layers.c has what
it runs and why): the layers' operands are laid out once, as a DECODE_LAYER array of pointers,
and each step passes its buffers and tables in one DECODE_STEP.

The arrays hold raw pointers: a DecodeLayers keeps a reference to every tensor it points into.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu as cpu_kernels
from kernels.cpu.blocked_linear import BlockedWeight

# decode_layers.c's strata_decode_layer, field for field.
DECODE_LAYER = np.dtype([
    ("input_norm", np.uintp), ("post_norm", np.uintp), ("q_norm", np.uintp), ("k_norm", np.uintp),
    ("qkv", np.uintp), ("o", np.uintp), ("gate_up", np.uintp), ("down", np.uintp),
    ("qkv_bias", np.uintp), ("o_bias", np.uintp), ("gate_up_bias", np.uintp), ("down_bias", np.uintp),
    ("k_cache", np.uintp), ("v_cache", np.uintp), ("num_slots", np.int64), ("gate_up_swiglu", np.int32)],
    align=True)
# decode_layers.c's strata_decode_step.
DECODE_STEP = np.dtype([
    ("h", np.uintp), ("residual", np.uintp), ("x", np.uintp), ("qkv", np.uintp), ("attn", np.uintp),
    ("gate_up", np.uintp), ("act", np.uintp), ("positions", np.uintp), ("slots", np.uintp),
    ("block_tables", np.uintp), ("context_lens", np.uintp), ("cos_sin", np.uintp), ("tokens", np.int64),
    ("hidden", np.int32), ("num_heads", np.int32), ("num_kv_heads", np.int32), ("head_dim", np.int32),
    ("intermediate", np.int32), ("block_size", np.int32), ("max_blocks", np.int32), ("threads", np.int32),
    ("eps", np.float32), ("scale", np.float32)], align=True)
# What a failing step's code names (decode_layers.c): the code is this plus -16 times the layer.
FAILURES = {-1: "a blocked linear has no kernel for this dtype on this CPU", -2: "a blocked linear's mode does "
            "not fit its weight", -3: "an fp32 gate/up weight packed to fuse SwiGLU", -4: "a cache slot outside "
            "the cache", -5: "the decode attention kernel failed"}


@dataclass
class DecodeLayer:
    """One decoder layer's operands for the fused step: norm weights in the model's dtype, the four
    projections as blocked weights (gate_up packed with swiglu only for a bf16 model), its caches."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: BlockedWeight
    o: BlockedWeight
    gate_up: BlockedWeight
    down: BlockedWeight
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class DecodeLayers:
    """The fused decode step of one model's layers over its caches; one step at a time (the step
    struct is reused)."""

    def __init__(self, layers: list[DecodeLayer], num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, scale: float, cos_sin: torch.Tensor, dtype: torch.dtype):
        """Checks every operand once (dtypes, shapes, contiguity), so that a step checks only its own."""
        if dtype not in cpu_kernels.KERNEL_DTYPES or cpu_kernels.load() is None:
            raise ValueError(f"the fused decode step runs fp32 or bf16 with the CPU kernels built, not {dtype}")
        first = layers[0]
        hidden, inter = first.input_norm.numel(), first.down.in_features
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        shapes = {"qkv": (q_width + 2 * kv_width, hidden), "o": (hidden, q_width),
                  "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[-1] != head_dim:
            raise ValueError(f"the rotary table must be contiguous fp32 [max_position, {head_dim}]")
        self._held = [cos_sin]  # everything the pointer arrays point into
        self.table = np.zeros(len(layers), dtype=DECODE_LAYER)
        for i, layer in enumerate(layers):
            for name, shape in shapes.items():
                w = getattr(layer, name)
                if (w.out_features, w.in_features) != shape or (w.swiglu and dtype != torch.bfloat16):
                    raise ValueError(f"layer {i}'s {name} is {w.out_features}x{w.in_features}"
                                     f"{' (SwiGLU-fused)' if w.swiglu else ''}, the fused step needs {shape[0]}x{shape[1]}")
            norms = [layer.input_norm, layer.post_norm] + [t for t in (layer.q_norm, layer.k_norm) if t is not None]
            caches = (layer.k_cache, layer.v_cache)
            if any(t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" for t in norms + list(caches)) \
                    or caches[0].shape != caches[1].shape or caches[0].shape[2:] != (num_kv_heads, head_dim):
                raise ValueError(f"layer {i}: norms and caches must be contiguous CPU {dtype} tensors, caches "
                                 f"[blocks, block_size, {num_kv_heads}, {head_dim}]")
            self.table[i] = (
                _ptr(layer.input_norm), _ptr(layer.post_norm), _ptr(layer.q_norm), _ptr(layer.k_norm),
                layer.qkv.words.data_ptr(), layer.o.words.data_ptr(), layer.gate_up.words.data_ptr(),
                layer.down.words.data_ptr(), _ptr(layer.qkv.bias), _ptr(layer.o.bias), _ptr(layer.gate_up.bias),
                _ptr(layer.down.bias), _ptr(layer.k_cache), _ptr(layer.v_cache),
                layer.k_cache.shape[0] * layer.k_cache.shape[1], int(layer.gate_up.swiglu))
            self._held.append(layer)
        self.fuses_swiglu = all(layer.gate_up.swiglu for layer in layers)
        self.dtype, self.hidden = dtype, hidden
        # A step's scratch rows, one buffer: (DECODE_STEP field, elements per token)
        self.scratch_widths = (("x", hidden), ("qkv", q_width + 2 * kv_width), ("attn", q_width), ("act", inter),
                               ("gate_up", 0 if self.fuses_swiglu else 2 * inter))
        self.step = np.zeros((), dtype=DECODE_STEP)
        for name, value in (("hidden", hidden), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("intermediate", inter), ("block_size", first.k_cache.shape[1]),
                            ("eps", eps), ("scale", scale), ("cos_sin", cos_sin.data_ptr())):
            self.step[name] = value
        self._function = f"strata_decode_layers_{cpu_kernels.KERNEL_DTYPES[dtype]}"  # looked up per step: see using()

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [tokens, hidden]: the embeddings of one new token per sequence (overwritten); positions
        and slot_mapping [tokens] int64; block_tables [tokens, max_blocks] and context_lens [tokens]
        int32 (the new token included). Returns (h, residual) after the last layer, as the
        op-by-op forward has them before its final norm."""
        n = h.shape[0]
        if (h.dtype != self.dtype or h.shape != (n, self.hidden) or not h.is_contiguous()
                or any(t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (n,) for t in (positions, slot_mapping))
                or any(t.dtype != torch.int32 or not t.is_contiguous() for t in (block_tables, context_lens))
                or block_tables.dim() != 2 or block_tables.shape[0] != n or context_lens.shape != (n,)):
            raise ValueError("fused decode step: h [tokens, hidden] contiguous in the model's dtype, positions and "
                             "slots [tokens] int64, block tables [tokens, max_blocks] and context lengths [tokens] int32")
        residual = torch.empty_like(h)
        scratch = torch.empty(n * sum(width for _, width in self.scratch_widths), dtype=self.dtype)
        s = self.step
        s["h"], s["residual"], s["tokens"] = h.data_ptr(), residual.data_ptr(), n
        base, size = scratch.data_ptr(), scratch.element_size()
        offset = 0
        for name, width in self.scratch_widths:
            s[name] = base + offset * size
            offset += n * width
        s["positions"], s["slots"] = positions.data_ptr(), slot_mapping.data_ptr()
        s["block_tables"], s["context_lens"] = block_tables.data_ptr(), context_lens.data_ptr()
        s["max_blocks"], s["threads"] = block_tables.shape[1], torch.get_num_threads()
        rc = getattr(cpu_kernels.load(), self._function)(self.table.ctypes.data, len(self.table), s.ctypes.data)
        if rc:
            layer, code = divmod(-rc, 16)
            raise RuntimeError(f"fused decode step failed in layer {layer}: {FAILURES.get(-code, f'code {-code}')}")
        return h, residual
