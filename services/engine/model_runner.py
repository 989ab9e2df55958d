"""Owns the model, the KV cache and the sampler; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

import ctypes
import time
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.engine.attention import AttentionMetadata
from services.engine.backends import select_ops
from services.engine.config import EngineArgs
from services.engine.model import LlamaModel
from services.engine.model_config import ModelConfig
from services.engine import prompt_logprobs
from services.engine.quantization import kv_cache as quantized_kv
from services.engine.quantization.loader import linear_loader, resolve as resolve_quantization
from services.engine.sampler import SampleResult, Sampler
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _keep_freed_memory_on_cpu() -> None:
    """Per-step tensors of a few MB would otherwise be mmap'ed and unmapped by glibc every step,
    and the page faults cost more than the attention itself. Keep them on the heap, whatever
    their size: glibc maps anything over 32 MB anew however high its threshold is set, and a
    prefill chunk's activations pass that (2048 rows of Qwen2.5-0.5B's gate_up are 40 MB: 240k
    faults in bench/engine_realistic.py's L throughput run, about 7% of its time). Without mmap
    the main heap grows by brk, or by mmap where brk cannot (glibc's fallback)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
            libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD (glibc's maximum)
            libc.mallopt(-4, 0)  # M_MMAP_MAX: no allocation is mmap'ed
        except OSError:
            pass


def cpu_has_native_bf16() -> bool:
    """bf16 dot-product instructions (AVX512-BF16 or AMX on x86, BF16 on Arm): there bf16 matmuls
    run at about 4x fp32's rate; elsewhere oneDNN emulates them, slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16", "bf16"))


def auto_dtype(device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """dtype=auto: the checkpoint's dtype where the device runs it natively. On CUDA fp32
    checkpoints run in bf16 (as vLLM does); on CPU bf16 runs in bf16 where the CPU has bf16
    instructions, and fp16 (no fast CPU path) and everything else in fp32."""
    stored = _DTYPES.get(checkpoint_dtype.removeprefix("torch."), torch.float32)
    if device.type == "cuda":
        return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16
    if stored == torch.bfloat16 and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


# One engine step, phase by phase (seconds). `other` is the step's wall time minus the named
# phases: Python between them, lock and GIL waits, the debug delay; on a GPU, whatever the host
# does while the device waits shows up in it rather than vanishing into `forward`.
STEP_PHASES = ("schedule", "propose", "prepare", "forward", "sample", "detokenize", "bookkeeping", "other")


@dataclass
class StepTimings:
    schedule: float = 0.0  # host: choosing the batch, allocating blocks
    propose: float = 0.0  # speculative decoding: n-gram lookups or the draft model's forwards
    prepare: float = 0.0  # host: building the input tensors
    forward: float = 0.0  # device: the model forward and logits (synchronized on CUDA)
    sample: float = 0.0
    detokenize: float = 0.0
    bookkeeping: float = 0.0  # host: prefix-cache registration, stop checks, step outputs
    other: float = 0.0
    wall: float = 0.0  # the whole step; the phases add up to it
    steps: int = 0

    def add(self, step: "StepTimings") -> None:
        for name in (*STEP_PHASES, "wall", "steps"):
            setattr(self, name, getattr(self, name) + getattr(step, name))


class ModelRunner:
    def __init__(self, config: ModelConfig, args: EngineArgs):
        self.config, self.args = config, args
        self.device = torch.device(args.device)
        self.dtype = self._resolve_dtype(args.dtype)
        if self.device.type == "cpu":
            _keep_freed_memory_on_cpu()
            if args.num_threads:
                torch.set_num_threads(args.num_threads)
        # Quantization (services.engine.quantization): of the weights, as the checkpoint or the
        # `quantization` argument says; of the KV cache, as kv_cache_dtype says.
        self.quantization = resolve_quantization(args.quantization, config.path)
        self.kv_cache_dtype = args.kv_cache_dtype
        self.ops = quantized_kv.attention_ops(select_ops(self.device, args.attention_backend), args.kv_cache_dtype)
        self.model = LlamaModel(config, self.dtype, self.device, self.ops, linear_loader(self.quantization))
        self.lora = None  # LoRAManager: adapters beside the base weights (enable_lora)
        if args.enable_lora:
            from services.engine.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, config, args.max_loras, args.max_lora_rank,
                                    args.max_cpu_loras or args.max_loras, self.dtype, self.device,
                                    use_triton=self.ops.name == "triton")
        self.block_size = args.block_size
        self.num_blocks = args.num_kv_blocks or self._auto_num_blocks()
        shape = (self.num_blocks, self.block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = quantized_kv.allocate(args.kv_cache_dtype, config.num_layers, shape, self.dtype, self.device)
        self.sampler = Sampler(config.vocab_size, self.device, backend=args.sampler_backend)
        self.sampler.warm_up(self.dtype)
        self.model.warm_up(args.max_num_batched_tokens, args.max_num_seqs)
        # Speculative decoding: samples the steps that verify drafts (spec_decode.Verifier).
        self.verifier = None
        self.verify_as_decode_rows = self.ops.name == "torch" and self.device.type == "cpu"
        self.graphs = None
        self.prompt_logprob_rows: list[prompt_logprobs.PromptLogprobRows] = []  # of the batch prepare() flattened
        if args.fuse_cpu_decode and self.lora is None:  # LoRA deltas run op by op
            self.model.fuse_decode(self.kv_caches)
        # Decode graphs capture no LoRA deltas: with adapters every step runs eagerly.
        if self.device.type == "cuda" and args.enable_cuda_graphs and self.ops.name == "triton" and self.lora is None:
            from services.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-(args.max_model_len or config.max_position_embeddings) // self.block_size)
            with torch.inference_mode():
                self.graphs = DecodeGraphs(self.model, self.kv_caches, args.max_num_seqs, max_blocks, self.device)

    def _resolve_dtype(self, dtype: str) -> torch.dtype:
        if dtype == "auto":
            return auto_dtype(self.device, self.config.torch_dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]

    @property
    def kv_bytes_per_block(self) -> int:
        c = self.config
        return self.block_size * quantized_kv.bytes_per_token(self.kv_cache_dtype, self.dtype, c.num_layers,
                                                              c.num_kv_heads, c.head_dim)

    def _auto_num_blocks(self) -> int:
        """Size the cache from what the device has."""
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = free * self.args.gpu_memory_utilization - self.args.activation_reserve_bytes
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(available * self.args.cpu_kv_cache_fraction, self.args.cpu_kv_cache_max_bytes)
        blocks = int(budget // self.kv_bytes_per_block)
        # No point holding more than max_num_seqs full-length sequences (and their prefixes) on CPU.
        if self.device.type == "cpu":
            cap = 4 * self.args.max_num_seqs * -(-self.config.max_position_embeddings // self.block_size)
            blocks = min(blocks, cap)
        if blocks < 2:
            raise RuntimeError(f"not enough memory for the KV cache ({budget / 2**20:.0f} MiB available)")
        return blocks

    # ---- one step ---------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one KV block, every layer (a forked choice's copy of its prompt's last block)."""
        for layer in self.kv_caches:
            for cache in layer:
                quantized = isinstance(cache, quantized_kv.QuantizedKVCache)
                for t in ((cache.data, cache.scales) if quantized else (cache,)):
                    t[dst].copy_(t[src])

    def prepare(self, batch: ScheduledBatch, with_prompt_logprobs: bool = False):
        """Flatten a scheduled batch: decode tokens first, then prefill chunks. A sequence with
        drafts to verify is a prefill chunk (the extend path), or on CPU's torch backend one
        decode row per token, each with its own context length (its causal mask): the decode
        kernel is several times faster than SDPA over a gathered context for a few queries."""
        bs = self.block_size
        decodes, prefills = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            decode = (n == 1 and seq.num_computed_tokens > 0) or (self.verify_as_decode_rows and seq.spec_token_ids)
            (decodes if decode else prefills).append((seq, n))
        if self.lora is not None:  # decodes of one adapter side by side: one run each (LoRALinear)
            decodes.sort(key=lambda item: self.lora.slot(item[0].lora_name))
        order = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in order:
            start = seq.num_computed_tokens
            if seq.spec_token_ids:  # the last token, then the drafts to verify after it
                input_ids.extend((seq.token_ids[start:] + seq.spec_token_ids)[:n])
            else:
                input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:  # a prefill chunk: its slots in one numpy expression, not a Python loop per token
                span = np.arange(start, start + n)
                slots.extend((np.asarray(table, dtype=np.int64)[span // bs] * bs + span % bs).tolist())

        def tables(group, rows_per_seq=lambda n: 1) -> torch.Tensor:
            width = max((len(s.block_table) for s, _ in group), default=0)
            padded = [row for s, n in group for row in [s.block_table + [0] * (width - len(s.block_table))]
                      * rows_per_seq(n)]
            return torch.tensor(padded, dtype=torch.int32).view(len(padded), width)

        decode_lens = [s.num_computed_tokens + j + 1 for s, n in decodes for j in range(n)]
        prefill_qlens = [n for _, n in prefills]
        prefill_ctx = [s.num_computed_tokens + n for s, n in prefills]
        starts = [0]
        for n in prefill_qlens:
            starts.append(starts[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            num_decodes=len(decode_lens),  # rows: a verifying sequence has one per token
            decode_block_tables=tables(decodes, lambda n: n).to(dev, non_blocking=True),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32).to(dev, non_blocking=True),
            decode_max_context=max(decode_lens, default=0),
            num_prefill_tokens=sum(prefill_qlens),
            prefill_block_tables=tables(prefills).to(dev, non_blocking=True),
            prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32).to(dev, non_blocking=True),
            prefill_context_lens=torch.tensor(prefill_ctx, dtype=torch.int32).to(dev, non_blocking=True),
            prefill_query_lens_host=prefill_qlens,
            prefill_context_lens_host=prefill_ctx,
        )
        # Sample only for sequences whose chunk reaches their last token; a sequence with m
        # drafts has m + 1 rows (one per draft it verifies, and the token after them).
        sample_rows, sample_seqs = [], []
        offset = 0
        for seq, n in order:
            offset += n
            m = len(seq.spec_token_ids)
            if seq.num_computed_tokens + n == seq.num_tokens + m:
                sample_rows.extend(range(offset - 1 - m, offset))
                sample_seqs.extend([seq] * (m + 1))
        if self.lora is not None:
            self.lora.set_batch([(self.lora.slot(seq.lora_name), n) for seq, n in order])
        # The rows whose logits give prompt logprobs (execute computes them after the forward).
        self.prompt_logprob_rows = prompt_logprobs.plan(order) if with_prompt_logprobs else []
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        return ids, pos, meta, sample_rows, sample_seqs

    @staticmethod
    def _is_decode_only(batch: ScheduledBatch) -> bool:
        return all(n == 1 and s.num_computed_tokens == s.num_tokens - 1 for s, n in zip(batch.seqs, batch.num_new_tokens))

    def _decode_with_graph(self, seqs: list[Sequence]) -> torch.Tensor:
        bs = self.block_size
        positions = [s.num_computed_tokens for s in seqs]
        return self.graphs.run(
            input_ids=[s.token_ids[p] for s, p in zip(seqs, positions)], positions=positions,
            slots=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)],
            tables=[s.block_table for s in seqs], context_lens=[p + 1 for p in positions])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, timings: StepTimings | None = None
                ) -> tuple[list[Sequence], SampleResult]:
        t0 = time.perf_counter()
        verify = False  # drafts to verify: they come as several tokens per sequence, never on the graph path
        if self.graphs is not None and self._is_decode_only(batch) and self.graphs.can_run(len(batch.seqs)):
            seqs = batch.seqs
            sampling = self.sampler.prepare(seqs)
            hidden = self._decode_with_graph(seqs)
            t1 = time.perf_counter()
            logits = self.model.logits(hidden)
        else:
            ids, pos, meta, rows, seqs = self.prepare(batch, with_prompt_logprobs=True)
            verify = self.verifier is not None and len(seqs) > len(set(seqs))
            sampling = (self.verifier if verify else self.sampler).prepare(seqs)
            t1 = time.perf_counter()
            hidden = self.model.forward(ids, pos, meta, self.kv_caches)
            logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None
            if self.prompt_logprob_rows:
                prompt_logprobs.compute(self.model.logits, hidden, self.prompt_logprob_rows, self.config.vocab_size)
        if logits is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        if logits is None:
            result = SampleResult([], [])
        elif verify:  # a sequence per token: several for those whose drafts were accepted
            seqs, result = self.verifier.sample(logits, sampling)
        else:
            result = self.sampler.sample(logits, sampling)
        t3 = time.perf_counter()
        if timings is not None:
            timings.prepare += t1 - t0
            timings.forward += t2 - t1
            timings.sample += t3 - t2
        return seqs, result

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """The forward pass of a batch and the logits of its sampling rows, without sampling
        (a draft model's proposals: the proposer samples them itself)."""
        ids, pos, meta, rows, seqs = self.prepare(batch)
        hidden = self.model.forward(ids, pos, meta, self.kv_caches)
        return seqs, (self.model.logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None)
