"""A fused linear layer with LoRA deltas beside it: `LoRALinear(x)` is the base `Linear(x)` (its
weights untouched, prepacked as they are) plus each token's adapter delta.

Which adapter each token uses is the step's `LoRABatch`, set once per step by the model runner
and read by every LoRALinear. On CPU the tokens come in runs of consecutive tokens of one adapter
(SGMV-style: the runner puts decodes of one adapter next to each other; a prefill chunk is one
run). Long runs get two torch matmuls per adapter (the runs of one adapter gathered into one
operand, so a prefill of many requests costs one matmul pair per adapter, not per request).
Short runs (decodes) go through one C call per layer whatever the mix (kernels/cpu/lora.c: the
shrink, and the expand over the nonzero blocks of B, added in place): at decode sizes a torch
matmul per adapter, or the gather, batched matmuls and index_add that group them, cost more in
calls than in arithmetic. Without the C kernels (no compiler, fp16), more than two short runs
go together through that grouped torch path: their tokens gathered into one padded group per
slot ([slots, longest group, in]), a batched shrink and expand against every slot's A and B
(torch.bmm), and the deltas added back to their tokens.
On CUDA it is the gathered BGMV Triton kernels of kernels.lora, two launches per layer whatever
the mix.
"""

from __future__ import annotations

import torch

from kernels import cpu as cpu_kernels
from services.engine.linear import Linear


# CPU: runs of at least LONG_RUN tokens get matmuls of their adapter's own; shorter ones go to
# the C kernel, or without it, when more than MAX_SHORT_RUNS, through the grouped torch path.
LONG_RUN = 16
MAX_SHORT_RUNS = 2


class LoRABatch:
    def __init__(self, device: torch.device, use_triton: bool, num_slots: int = 1,
                 dtype: torch.dtype = torch.float32):
        self.device, self.use_triton, self.num_slots, self.dtype = device, use_triton, num_slots, dtype
        self.use_cpu_kernel = (not use_triton and device.type == "cpu" and dtype in cpu_kernels.KERNEL_DTYPES
                               and cpu_kernels.load() is not None)
        self.runs: list[tuple[int, int, int]] = []  # (start, end, slot) of tokens using an adapter
        self.token_slots: torch.Tensor | None = None  # [tokens] int32 on the device (Triton path)
        # Grouped short runs: (gather index [slots * longest], rows of it that are real tokens,
        # those tokens), token indices into the step's batch.
        self.grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Short runs for the C kernel: (tokens, group starts, group slots), int64, one group per slot.
        self.kernel_groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Long runs, per slot: (slot, token slice, or token indices when the slot's runs are apart)
        self.own_runs: list[tuple[int, slice | torch.Tensor]] = []

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
        self.runs, self.own_runs = runs, []
        self.token_slots = self.grouped = self.kernel_groups = None
        own = runs
        if runs and self.use_triton:
            slots = torch.full((start,), -1, dtype=torch.int32)
            for s, e, slot in runs:
                slots[s:e] = slot
            self.token_slots = slots.to(self.device, non_blocking=True)
        else:
            short = [r for r in runs if r[1] - r[0] < LONG_RUN]
            groups: dict[int, list[int]] = {}
            for s, e, slot in short:
                groups.setdefault(slot, []).extend(range(s, e))
            if short and self.use_cpu_kernel:
                starts = [0]
                for members in groups.values():
                    starts.append(starts[-1] + len(members))
                self.kernel_groups = (torch.tensor([t for members in groups.values() for t in members]),
                                      torch.tensor(starts), torch.tensor(list(groups)))
                own = [r for r in runs if r[1] - r[0] >= LONG_RUN]
            elif len(short) > MAX_SHORT_RUNS:
                longest = max(map(len, groups.values()))
                gather = torch.full((self.num_slots, longest), short[0][0], dtype=torch.int64)
                rows, tokens = [], []
                for slot, members in groups.items():
                    gather[slot, :len(members)] = torch.tensor(members)
                    rows.extend(range(slot * longest, slot * longest + len(members)))
                    tokens.extend(members)
                self.grouped = tuple(t.to(self.device, non_blocking=True) for t in (
                    gather.view(-1), torch.tensor(rows, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64)))
                own = [r for r in runs if r[1] - r[0] >= LONG_RUN]
            by_slot: dict[int, list[tuple[int, int]]] = {}
            for s, e, slot in own:
                by_slot.setdefault(slot, []).append((s, e))
            self.own_runs = [(slot, slice(*spans[0]) if len(spans) == 1 else torch.cat(
                [torch.arange(s, e) for s, e in spans]).to(self.device, non_blocking=True))
                for slot, spans in by_slot.items()]


class LoRALinear:
    """Called like a Linear; every other attribute is the base layer's. `slice_outs`: the output
    width of each fused slice, B being block-diagonal over them (one slice, a dense B, if not
    given)."""

    def __init__(self, base: Linear, a_stack: torch.Tensor, b_stack: torch.Tensor, batch: LoRABatch,
                 slice_outs: list[int] | None = None):
        self.base, self.a_stack, self.b_stack, self.batch = base, a_stack, b_stack, batch
        self.a_stack_t = a_stack.transpose(1, 2)  # [slots, in, rows]: the batched shrink's operand
        widths = slice_outs or [b_stack.shape[2]]
        if sum(widths) != b_stack.shape[2] or a_stack.shape[1] % len(widths):
            raise ValueError(f"slices {widths} do not fit B {tuple(b_stack.shape)}")
        self.slice_cols = torch.tensor([0, *widths]).cumsum(0)  # column bounds of each slice

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
        if batch.kernel_groups is not None:
            cpu_kernels.lora_sgmv(x, self.a_stack, self.b_stack, self.slice_cols, batch.kernel_groups, out)
        elif batch.grouped is not None:
            gather, rows, tokens = batch.grouped
            slots = self.a_stack.shape[0]
            grouped = x.index_select(0, gather).view(slots, -1, x.shape[1])
            delta = torch.bmm(torch.bmm(grouped, self.a_stack_t), self.b_stack)
            out.index_add_(0, tokens, delta.view(-1, out.shape[1]).index_select(0, rows))
        for slot, tokens in batch.own_runs:
            if isinstance(tokens, slice):
                out[tokens].addmm_(torch.mm(x[tokens], self.a_stack[slot].t()), self.b_stack[slot])
            else:
                shrunk = torch.mm(x.index_select(0, tokens), self.a_stack[slot].t())
                out.index_add_(0, tokens, torch.mm(shrunk, self.b_stack[slot]))
        return out
