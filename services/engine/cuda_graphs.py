"""Decode steps replayed from CUDA graphs, one captured per padded batch size.

A decode step of a small model is dominated by kernel launches; a graph replays the whole
forward pass with one launch. Inputs live in static buffers: a batch of B sequences is padded to
the next captured size with slot -1 (the KV write skips it) and context length 0 (attention
returns zeros), and the first B rows of the output are used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def cuda_graph_capture(forward: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor, object]:
    """Capture forward() once; returns (replay, its static output, the memory pool to share)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm-up outside the graph: compiles kernels, sets up allocations
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph.replay, out, graph.pool()


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 capture: Callable = cuda_graph_capture):
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        self.replays: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size], num_decodes=size,
                decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
                decode_max_context=0, num_prefill_tokens=0, prefill_block_tables=empty.view(0, 0),
                prefill_query_start_loc=empty, prefill_context_lens=empty, prefill_query_lens_host=[],
                prefill_context_lens_host=[])

            def forward(size=size, meta=meta):
                return model.forward(self.input_ids[:size], self.positions[:size], meta, kv_caches)

            replay, out, pool = capture(forward, pool)
            self.replays[size] = (replay, out)

    def can_run(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        b = len(input_ids)
        size = next(s for s in self.sizes if s >= b)
        dev = self.input_ids.device
        self.input_ids[:b].copy_(torch.tensor(input_ids, dtype=torch.int64), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        self.slot_mapping[:b].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        self.slot_mapping[b:size].fill_(-1)
        self.context_lens[:b].copy_(torch.tensor(context_lens, dtype=torch.int32), non_blocking=True)
        self.context_lens[b:size].zero_()
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.block_tables[:b, :width].copy_(padded.to(dev, non_blocking=True))
        replay, out = self.replays[size]
        replay()
        return out[:b]
