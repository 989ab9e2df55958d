"""One linear layer's weight, held in the layout its device's matmul reads fastest.

On CPU the weight is laid out once, at load, for the kernel that runs it, and the plain weight
is not kept:
- bf16 on a CPU with AVX512-BF16: kernels/cpu/blocked_linear.c's layout, 16 output channels by
  pairs of inputs. One sequential stream per thread, no per-call dispatch: one row runs
  1.2-1.9x faster than oneDNN's packed matmul and 4 rows 1.1-1.4x; from 16 rows to prefill
  chunks both are within a few percent (bench/blocked_linear.py, on a Zen 4). Rows need no
  padding to shape buckets. With AMX the same layout is the tiles' operand, read in place: on a
  2-core Xeon with AMX, 0.99-1.71x oneDNN's bf16 matmul (itself on AMX) at 1-64 rows and
  0.60-1.38x at 256-2048 (kernels/cpu/blocked_linear.c).
- fp32 whose values are all bf16 (a bf16 checkpoint run in fp32, as on CPUs without bf16
  instructions), with the AVX2 kernel: the same values as bf16 in the blocked layout. On an AVX2
  CPU without AVX-512 ("blocked", `blocked_linear.f32_outruns_onednn`) every call runs there:
  decode batches read half the bytes (1.5-2.5x oneDNN's fp32 matmul at 1-4 rows) and prefill
  chunks run 0.97-1.25x as fast at 64-2048 rows (bench/blocked_linear.py --fp32 on a Zen 3);
  the weight takes half the fp32 bytes. With AVX-512 ("onednn+blocked") the kernel's 512-bit
  tiles run decode batches of 1-32 rows 1.2-3.2x as fast as oneDNN's fp32 matmul, and oneDNN
  wins from about 96 rows (bench/blocked_linear.py --fp32 on an Ice Lake Xeon): oneDNN's layout
  is held too and takes the calls of more than SMALL_CALL_ROWS rows, 1.5x the fp32 weight's
  bytes.
- otherwise fp32 or bf16 where oneDNN runs them: oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the prepacking torch's own CPU compiler uses, and
  vLLM's CPU backend does the same through oneDNN). A plain `F.linear` re-packs the whole weight
  inside every call; at decode batch sizes that costs as much as the product itself.
Elsewhere (CUDA, a torch without oneDNN, bf16 on a CPU without oneDNN's bf16 path) the weight
stays plain and `F.linear` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import blocked_linear

# The batch size oneDNN tunes the packed layout for (as vLLM's CPU backend does): good from
# decode batches to prefill chunks.
PACK_BATCH_HINT = 32
# The most rows an fp32 call runs on a weight's bf16 blocked copy (layout "onednn+blocked"): on
# M's and L's ten linear shapes the kernel's AVX-512 tiles ran 1.2-1.6x as fast as oneDNN's fp32
# matmul at 32 rows, 0.97-1.57x at 64, 0.82-1.19x at 96 and 0.69-0.96x at 256 (2 threads, an Ice
# Lake Xeon; bench/results/blocked_linear_fp32_icelake_stop47.json).
SMALL_CALL_ROWS = 64


def row_bucket(rows: int) -> int:
    """The row count a packed CPU matmul runs at for `rows` rows (the model pads to it).

    oneDNN builds a primitive for every shape it meets, 0.5-2 ms on a 2-core CPU: as long as a
    whole decode step's matmuls. A continuous batch meets a new row count almost every step (a
    sequence joins or ends, a prefill chunk has its own length), so exact row counts would pay
    that again and again. Rounded up to 8 sizes per octave (to multiples of 8 up to 64 rows),
    55 sizes cover 1-2048 rows and their primitives stay in oneDNN's cache (1024 entries).
    Above 64 rows the padding is under 1/8; below, the matmul reads the weights either way."""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def cpu_prepacking_available(dtype: torch.dtype) -> bool:
    """oneDNN can pack (and run) `dtype` weights on this CPU. Its bf16 path needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT: on an AVX2-only CPU bf16 weights stay plain and F.linear runs them, as
    vLLM's CPU backend falls back there too."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_layout(weight: torch.Tensor) -> str:
    """The layout a CPU weight is held in: "blocked" (Strata's kernel over bf16 values: a bf16
    weight, or an fp32 one of bf16 values where the fp32 path outruns oneDNN), "onednn" (oneDNN's
    packed matmul), "onednn+blocked" (an fp32 weight of bf16 values elsewhere: oneDNN's layout,
    and the bf16 values blocked for calls of up to SMALL_CALL_ROWS rows) or "plain" (F.linear)."""
    if blocked_linear.packable(weight) and blocked_linear.available():
        return "blocked"
    bf16_values = blocked_linear.available_f32() and blocked_linear.packable_as_bf16(weight)
    if bf16_values and blocked_linear.f32_outruns_onednn():
        return "blocked"
    if not cpu_prepacking_available(weight.dtype):
        return "plain"
    return "onednn+blocked" if bf16_values else "onednn"


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool | None = None,
                 swiglu: bool = False):
        """prepack: lay the weight out for the CPU's kernel (default: on CPU); False keeps it plain.
        swiglu: the weight is SwiGLU's [gate; up]; where the layout allows, `swiglu` fuses the
        activation into the product (`fuses_swiglu`), and calls still return [gate | up]."""
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        if prepack is None:
            prepack = weight.device.type == "cpu"
        self.layout = cpu_layout(weight) if prepack else "plain"
        self.fuses_swiglu = swiglu and self.layout == "blocked" and blocked_linear.packable(weight, swiglu=True)
        self.blocked = None  # the blocked layout: every call ("blocked"), or the small ones
        if self.layout in ("blocked", "onednn+blocked"):  # an fp32 weight's values lose nothing as bf16
            self.blocked = blocked_linear.pack(weight.bfloat16(), bias, self.fuses_swiglu)
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
                       if self.layout.startswith("onednn") else None)
        self.weight = weight if self.layout == "plain" else None
        self.bias = None if self.layout == "blocked" else bias  # the blocked kernel holds it, in fp32

    @property
    def wants_row_buckets(self) -> bool:
        """Whether calls should come at bucketed row counts (linear.row_bucket): oneDNN builds a
        primitive per shape; the blocked kernel and F.linear take any count as it is."""
        return self.packed is not None

    def blocked_for(self, rows: int) -> blocked_linear.BlockedWeight | None:
        """The blocked weight a call of `rows` rows runs on, or None where another kernel takes it."""
        return self.blocked if self.blocked is not None and (self.packed is None or rows <= SMALL_CALL_ROWS) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (blocked := self.blocked_for(x.numel() // self.in_features)) is not None:
            return blocked_linear.linear(x, blocked)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] projection in one pass (where `fuses_swiglu`): the
        bits of backends' silu_and_mul on the product, without writing the product."""
        if not self.fuses_swiglu:
            raise ValueError("this Linear does not fuse SwiGLU (not a [gate; up] weight in the blocked layout)")
        return blocked_linear.swiglu(x, self.blocked)

    @property
    def nbytes(self) -> int:
        """Bytes the weight (and bias) occupy as held."""
        if self.layout == "blocked":
            return self.blocked.nbytes
        held = torch.ops.mkldnn._nbytes(self.packed) if self.packed is not None \
            else self.weight.numel() * self.weight.element_size()
        held += 0 if self.blocked is None else self.blocked.nbytes
        return held + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
