"""A fused linear layer with LoRA deltas beside it: `LoRALinear(x)` is the base `Linear(x)` (its
weights untouched, prepacked as they are) plus each token's adapter delta.

Which adapter each token uses is the step's `LoRABatch`, set once per step by the model runner
and read by every LoRALinear. On CPU the delta runs as torch matmuls over runs of consecutive
tokens of one adapter (SGMV-style: the runner puts decodes of one adapter next to each other;
a prefill chunk is one run), two matmuls per run. On CUDA it is the gathered BGMV Triton
kernels of kernels.lora, two launches per layer whatever the mix.
"""

from __future__ import annotations

import torch

from services.engine.linear import Linear


class LoRABatch:
    def __init__(self, device: torch.device, use_triton: bool):
        self.device, self.use_triton = device, use_triton
        self.runs: list[tuple[int, int, int]] = []  # (start, end, slot) of tokens using an adapter
        self.token_slots: torch.Tensor | None = None  # [tokens] int32 on the device (Triton path)

    def set(self, slots_and_counts: list[tuple[int, int]]) -> None:
        runs: list[tuple[int, int, int]] = []
        start = 0
        for slot, n in slots_and_counts:
            if slot >= 0:
                if runs and runs[-1][1] == start and runs[-1][2] == slot:
                    runs[-1] = (runs[-1][0], start + n, slot)
                else:
                    runs.append((start, start + n, slot))
            start += n
        self.runs = runs
        self.token_slots = None
        if runs and self.use_triton:
            slots = torch.full((start,), -1, dtype=torch.int32)
            for s, e, slot in runs:
                slots[s:e] = slot
            self.token_slots = slots.to(self.device, non_blocking=True)


class LoRALinear:
    """Called like a Linear; every other attribute is the base layer's."""

    def __init__(self, base: Linear, a_stack: torch.Tensor, b_stack: torch.Tensor, batch: LoRABatch):
        self.base, self.a_stack, self.b_stack, self.batch = base, a_stack, b_stack, batch

    def __getattr__(self, name):
        return getattr(self.base, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if not batch.runs:
            return out
        if batch.token_slots is not None:
            from kernels.lora import bgmv_expand, bgmv_shrink

            x2 = x.contiguous()
            y = bgmv_shrink(x2, self.a_stack, batch.token_slots)
            return bgmv_expand(y, self.b_stack, batch.token_slots, out)
        for start, end, slot in batch.runs:
            shrunk = torch.mm(x[start:end], self.a_stack[slot].t())
            out[start:end].addmm_(shrunk, self.b_stack[slot])
        return out
