"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step is a token budget (max_num_batched_tokens) over at most max_num_seqs sequences.
Running sequences go first, in admission order: decodes take one token each, an unfinished
prefill takes what the budget leaves (chunked prefill, so a long prompt never stalls decodes).
Waiting sequences are admitted strictly in order while blocks and budget last. When blocks run
out, the most recently admitted running sequence is preempted (its blocks freed, recomputed
later, ahead of new arrivals); no new sequence is admitted in a step that preempted, and
admission keeps a small watermark of free blocks for running decodes, so the batch does not
thrash between admitting and preempting. With LoRA adapters (`lora`: the engine's
LoRAManager), a waiting sequence whose adapter cannot get a device slot (every slot holds an
adapter that running sequences use) is passed over, and the ones behind it may run; once it
has waited LORA_MAX_PASS_OVER_S, nothing behind it is admitted until a slot frees for it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, SequenceStatus

LORA_MAX_PASS_OVER_S = 5.0  # then a passed-over request stops others from keeping every slot busy


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01, lora=None):
        self.block_manager = block_manager
        self.lora = lora  # has can_schedule(seq, running): its adapter is (now) resident
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_front(self, seq: Sequence) -> None:
        """Queue seq ahead of new arrivals (a choice forked without its blocks)."""
        self.waiting.appendleft(seq)

    def add_running(self, seq: Sequence) -> None:
        """A choice forked with its blocks (services.engine.choices): it decodes from the next step."""
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        # Forked choices may take running past max_num_seqs: the ones past it wait a step.
        while i < len(self.running) and budget > 0 and len(batch.seqs) < self.max_num_seqs:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is left in running

        if batch.preempted:
            return batch
        j = 0  # waiting sequences passed over (their adapter has no slot now)
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            if self.lora is not None and not self.lora.can_schedule(seq, self.running):
                if time.monotonic() - seq.arrival_time > LORA_MAX_PASS_OVER_S:
                    break  # running requests finish, and their slot goes to it
                j += 1
                continue
            cached = bm.match_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * bm.block_size, budget)
            fresh = bm.blocks_needed_for_admission(len(cached), num_new)
            if bm.num_free_blocks - fresh < self.watermark_blocks and self.running:
                break
            if not bm.admit(seq, num_new, cached):
                break
            del self.waiting[j]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) seq wherever it is and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
