"""A fused linear layer with LoRA deltas beside it: `LoRALinear(x)` is the base `Linear(x)` (its
weights untouched, prepacked as they are) plus each token's adapter delta.

Which adapter each token uses is the step's `LoRABatch`, set once per step by the model runner
and read by every LoRALinear. On CPU the tokens come in runs of consecutive tokens of one adapter
(SGMV-style: the runner puts decodes of one adapter next to each other; a prefill chunk is one
run). A long run gets two torch matmuls of its own. Short runs (decodes), when there are more
than two, go together in three calls whatever the mix: the shrink against every slot at once
(x @ A_all.T, [tokens, slots * rows]), a per-token mask keeping each token's own slot, and the
expand against every slot's B at once; the extra flops are those of a few rows per slot, far
cheaper on a CPU than a small matmul per adapter. On CUDA it is the gathered
BGMV Triton kernels of kernels.lora, two launches per layer whatever the mix.
"""

from __future__ import annotations

import torch

from services.engine.linear import Linear


# CPU: runs of at least LONG_RUN tokens get their own matmuls; more than MAX_SHORT_RUNS shorter
# ones go through the all-slots path together.
LONG_RUN = 16
MAX_SHORT_RUNS = 2


class LoRABatch:
    def __init__(self, device: torch.device, use_triton: bool, num_slots: int = 1,
                 dtype: torch.dtype = torch.float32):
        self.device, self.use_triton, self.num_slots, self.dtype = device, use_triton, num_slots, dtype
        self.runs: list[tuple[int, int, int]] = []  # (start, end, slot) of tokens using an adapter
        self.token_slots: torch.Tensor | None = None  # [tokens] int32 on the device (Triton path)
        # All-slots path: (first, end) tokens it covers and their mask [tokens, slots, 1], 1 at
        # each token's slot (0 for tokens of the base model or of a long run).
        self.dense: tuple[int, int, torch.Tensor] | None = None
        self.own_runs: list[tuple[int, int, int]] = []  # runs that get their own matmuls

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
        self.runs, self.own_runs = runs, runs
        self.token_slots = self.dense = None
        if runs and self.use_triton:
            slots = torch.full((start,), -1, dtype=torch.int32)
            for s, e, slot in runs:
                slots[s:e] = slot
            self.token_slots = slots.to(self.device, non_blocking=True)
        else:
            short = [r for r in runs if r[1] - r[0] < LONG_RUN]
            if len(short) > MAX_SHORT_RUNS:
                first, end = short[0][0], short[-1][1]
                mask = torch.zeros((end - first, self.num_slots, 1), dtype=self.dtype)
                for s, e, slot in short:
                    mask[s - first:e - first, slot] = 1
                self.dense = (first, end, mask.to(self.device, non_blocking=True))
                self.own_runs = [r for r in runs if r[1] - r[0] >= LONG_RUN]


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
        if batch.dense is not None:
            first, end, mask = batch.dense
            slots, rows, fan_in = self.a_stack.shape
            shrunk = torch.mm(x[first:end], self.a_stack.view(slots * rows, fan_in).t()).view(-1, slots, rows)
            shrunk.mul_(mask)
            out[first:end].addmm_(shrunk.view(-1, slots * rows), self.b_stack.view(slots * rows, -1))
        for start, end, slot in batch.own_runs:
            shrunk = torch.mm(x[start:end], self.a_stack[slot].t())
            out[start:end].addmm_(shrunk, self.b_stack[slot])
        return out
