"""One linear layer's weight, held in the layout its device's matmul reads fastest.

On CPU (fp32 or bf16) the weight is reordered once, at load, into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the prepacking torch's own CPU compiler uses, and
vLLM's CPU backend does the same through oneDNN). A plain `F.linear` re-packs the whole weight
inside every call; at decode batch sizes that costs as much as the product itself, and the
packed weights run the model's linear shapes 1.3-3x faster. The plain weight is not kept.
Elsewhere (CUDA, a torch without oneDNN, bf16 on a CPU without oneDNN's bf16 path) the weight
stays plain and `F.linear` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The batch size oneDNN tunes the packed layout for (as vLLM's CPU backend does): good from
# decode batches to prefill chunks.
PACK_BATCH_HINT = 32


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


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool | None = None):
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.bias = bias
        if prepack is None:
            prepack = weight.device.type == "cpu" and cpu_prepacking_available(weight.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT) if prepack else None
        self.weight = None if prepack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes the weight (and bias) occupy as held."""
        held = torch.ops.mkldnn._nbytes(self.packed) if self.packed is not None \
            else self.weight.numel() * self.weight.element_size()
        return held + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
