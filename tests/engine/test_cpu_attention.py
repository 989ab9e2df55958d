"""The CPU attention paths against the plain reference: the C decode kernel (kernels/cpu) and the
torch gather path, over non-contiguous block tables, ragged lengths and GQA ratios 1, 2, 4."""

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from services.engine.attention import AttentionMetadata, TorchAttention

BLOCK = 16
ATOL = 2e-5  # fp32; the C kernel sums in a different order than the reference


def paged_case(seed: int, lengths: list[int], kv_heads: int, group: int, head_dim: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 7
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, not contiguous
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for i in range(-(-n // BLOCK)):
            tables[b, i] = perm.pop()
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


CASES = [(kv, group, d) for kv, group in ((4, 1), (2, 2), (2, 4), (1, 8), (2, 7)) for d in (64, 128)]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group, head_dim", CASES)
def test_c_decode_kernel_matches_reference(kv_heads, group, head_dim, dtype):
    q, kc, vc, tables, lens = paged_case(1, [1, 15, 16, 17, 100, 257, 0], kv_heads, group, head_dim)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    scale = head_dim ** -0.5
    ours = cpu_kernels.paged_decode_attention(q, kc, vc, tables, lens, scale)
    assert ours.dtype == dtype
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, scale)  # fp32 math over the same inputs
    # bf16: the output is rounded to bf16 once (relative 2**-8); fp32: summation order only.
    atol, rtol = (ATOL, 0) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=rtol)
    assert torch.all(ours[-1] == 0)  # context length 0: zeros, not NaN


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_kernel_long_contexts(dtype):
    """Contexts to 4k tokens, GQA 8 at head_dim 128 (Qwen3 / Llama-3 shapes), batch of one."""
    for lengths in ([4096], [4000, 2049, 1]):
        q, kc, vc, tables, lens = paged_case(4, lengths, 1, 8, 128)
        q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
        ours = cpu_kernels.paged_decode_attention(q, kc, vc, tables, lens, 128 ** -0.5)
        ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 128 ** -0.5)
        atol, rtol = (1e-4, 0) if dtype == torch.float32 else (1e-2, 1e-2)
        torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("kv_heads, group, head_dim", CASES)
def test_torch_gather_path_matches_reference(kv_heads, group, head_dim):
    """The portable path (no C compiler, or non-fp32): decode and prefill with a cached prefix."""
    lengths = [5, 33, 64, 90]
    q, kc, vc, tables, lens = paged_case(2, lengths, kv_heads, group, head_dim)
    scale = head_dim ** -0.5
    attn = TorchAttention(kv_heads * group, kv_heads, head_dim, scale)
    attn.cpu_kernels = False
    empty = torch.zeros(0, dtype=torch.int32)
    decode_meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), len(lengths), tables, lens, 0, empty.view(0, 0),
                                    empty, empty, [], [], decode_max_context=max(lengths))
    torch.testing.assert_close(attn._decode(q, kc, vc, decode_meta),
                               paged_decode_attention_ref(q, kc, vc, tables, lens, scale), atol=ATOL, rtol=0)
    # Prefill chunks: the last 5, 33 (all: no prefix), 10 and 1 tokens of each sequence.
    chunks = [5, 33, 10, 1]
    g = torch.Generator().manual_seed(3)
    qp = torch.randn(sum(chunks), kv_heads * group, head_dim, generator=g)
    starts = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    # New keys/values for chunks without a prefix are passed in directly; read them from the cache.
    knew = torch.cat([kc[tables[b].long()].reshape(-1, kv_heads, head_dim)[n - c:n]
                      for b, (n, c) in enumerate(zip(lengths, chunks))])
    vnew = torch.cat([vc[tables[b].long()].reshape(-1, kv_heads, head_dim)[n - c:n]
                      for b, (n, c) in enumerate(zip(lengths, chunks))])
    prefill_meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), 0, empty.view(0, 0), empty, sum(chunks),
                                     tables, starts, lens, chunks, lengths)
    out = torch.empty_like(qp)
    attn._prefill(qp, knew, vnew, kc, vc, prefill_meta, out)
    torch.testing.assert_close(out, paged_prefill_attention_ref(qp, kc, vc, tables, starts, lens, scale),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_path_long_contexts(dtype):
    """Chunked prefill deep into a 4k context (a cached prefix of ~4000 tokens), GQA 8, head_dim 128,
    beside a fresh prompt with no prefix."""
    lengths, chunks = [4096, 300], [96, 300]
    q, kc, vc, tables, lens = paged_case(5, lengths, 1, 8, 128)
    kc, vc = kc.to(dtype), vc.to(dtype)
    scale = 128 ** -0.5
    attn = TorchAttention(8, 1, 128, scale)
    g = torch.Generator().manual_seed(6)
    qp = torch.randn(sum(chunks), 8, 128, generator=g).to(dtype)
    starts = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    knew = torch.cat([kc[tables[b].long()].reshape(-1, 1, 128)[n - c:n] for b, (n, c) in enumerate(zip(lengths, chunks))])
    vnew = torch.cat([vc[tables[b].long()].reshape(-1, 1, 128)[n - c:n] for b, (n, c) in enumerate(zip(lengths, chunks))])
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), 0, empty.view(0, 0), empty, sum(chunks),
                             tables, starts, lens, chunks, lengths)
    out = torch.empty_like(qp)
    attn._prefill(qp, knew, vnew, kc, vc, meta, out)
    ref = paged_prefill_attention_ref(qp, kc, vc, tables, starts, lens, scale)
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=1e-2)
