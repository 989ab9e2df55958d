"""The CPU attention paths against the plain reference: the C decode kernel (kernels/cpu) and the
torch gather path, over non-contiguous block tables, ragged lengths and GQA ratios 1, 2, 4, 7, 8;
and the C prefill kernel (kernels/cpu/prefill_attention.c) over chunks with and without cached
prefixes."""

import ctypes
import shutil
import subprocess
from pathlib import Path

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
# the decode kernel also takes a head_dim that ends mid-vector (36: AVX2 reads 4 x 8 lanes, then 4),
# one past its unrolled ones (80: AVX-512 scores 64 + 16 lanes) and groups its V pass takes three
# heads at a time (3, 5, 6)
DECODE_CASES = CASES + [(2, 3, 36), (1, 3, 80), (1, 5, 64), (1, 6, 128)]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group, head_dim", DECODE_CASES)
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


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_c_decode_kernel_strided_views_and_one_plan_for_every_layer(dtype, head_dim):
    """q a view into a fused qkv row (as the engine passes it), out a view into a wider buffer;
    one PagedDecode (the step's converted tables) serves several layers' caches. head_dim 80 runs
    the V accumulation's 16-lane tail as well as its 64-lane part."""
    kv_heads, group = 2, 7
    heads = kv_heads * group
    q, kc, vc, tables, lens = paged_case(11, [3, 16, 40, 130, 0], kv_heads, group, head_dim)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    fused = torch.zeros(q.shape[0], (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    fused[:, :heads * head_dim] = q.reshape(q.shape[0], -1)
    qv = fused[:, :heads * head_dim].view(q.shape)
    wide = torch.full((q.shape[0], heads * head_dim + 16), 7.0, dtype=dtype)
    out = wide[:, :heads * head_dim].view(q.shape)
    step = cpu_kernels.PagedDecode(tables, lens, head_dim ** -0.5)
    atol, rtol = (ATOL, 0) if dtype == torch.float32 else (1e-2, 1e-2)
    for layer in range(2):  # a second layer: other caches, the same converted tables
        k_l, v_l = (kc, vc) if layer == 0 else (vc.flip(0).contiguous(), kc.flip(0).contiguous())
        step(qv, k_l, v_l, out)
        ref = paged_decode_attention_ref(q.float(), k_l.float(), v_l.float(), tables, lens, head_dim ** -0.5)
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
        assert torch.all(wide[:, heads * head_dim:] == 7.0)  # nothing written past each row


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_rows_into_their_slots(dtype):
    """K and V as views into the fused qkv rows, stored in one call: the same cache as two
    index_copy_ calls; a slot outside the cache is refused and nothing is written."""
    kv_heads, head_dim, tokens = 2, 64, 9
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(tokens, (6 + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    k = qkv[:, 6 * head_dim:(6 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (6 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    kc = torch.zeros(5, BLOCK, kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 17, 18, 79, 0, 40, 41, 42, 64])
    cpu_kernels.store_kv(k, v, kc, vc, slots)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    ref_k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    ref_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    before = kc.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_kernels.store_kv(k, v, kc, vc, slots.clone().index_fill_(0, torch.tensor([4]), 80))
    assert torch.equal(kc, before)
    with pytest.raises(ValueError, match="one slot per"):
        cpu_kernels.store_kv(k, v, kc, vc, slots[:3])


@pytest.mark.parametrize("kv_heads, group, head_dim", CASES)
def test_torch_gather_path_matches_reference(kv_heads, group, head_dim):
    """The portable path (no C compiler, or non-fp32): decode and prefill with a cached prefix."""
    lengths = [5, 33, 64, 90]
    q, kc, vc, tables, lens = paged_case(2, lengths, kv_heads, group, head_dim)
    scale = head_dim ** -0.5
    attn = TorchAttention(kv_heads * group, kv_heads, head_dim, scale)
    attn.cpu_kernels = attn.prefill_kernel = False
    empty = torch.zeros(0, dtype=torch.int32)
    decode_meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), len(lengths), tables, lens, 0, empty.view(0, 0),
                                    empty, empty, [], [], decode_max_context=max(lengths))
    torch.testing.assert_close(attn._decode(q, kc, vc, decode_meta, torch.empty_like(q)),
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


# ---- the C prefill kernel (kernels/cpu/prefill_attention.c) ---------------------------------

# (cached prefix, new tokens): plain prefill, a block-aligned prefix + chunk, an unaligned one,
# a single new token, and chunks spanning several 64-key tiles and query blocks.
PREFILL_CHUNKS = [(0, 37), (32, 21), (45, 19), (29, 1), (0, 150), (70, 130)]


def prefill_case(seed: int, chunks: list[tuple[int, int]], kv_heads: int, group: int, head_dim: int,
                 dtype=torch.float32, block: int = BLOCK):
    """Caches holding every chunk's context (prefix and new tokens) in scattered blocks, the
    chunks' queries packed back to back, and the metadata tensors."""
    g = torch.Generator().manual_seed(seed)
    ctx = [p + n for p, n in chunks]
    num_blocks = sum(-(-c // block) for c in ctx) + 5
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(ctx), max(-(-c // block) for c in ctx) + 1, dtype=torch.int32)
    for b, c in enumerate(ctx):
        for i in range(-(-c // block)):
            tables[b, i] = perm.pop()
    qlens = [n for _, n in chunks]
    starts = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(qlens), kv_heads * group, head_dim, generator=g).mul(2).to(dtype)
    return q, k_cache, v_cache, tables, starts, torch.tensor(ctx, dtype=torch.int32)


def prefill_tolerance(dtype):
    # bf16: P rounded to bf16 for P x V and the output rounded once; fp32: summation order only.
    return (ATOL, 0) if dtype == torch.float32 else (1e-2, 1e-2)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group, head_dim", CASES)
def test_c_prefill_kernel_matches_reference(kv_heads, group, head_dim, dtype):
    """Several chunks of different lengths in one call, with and without cached prefixes."""
    q, kc, vc, tables, starts, ctx = prefill_case(7, PREFILL_CHUNKS, kv_heads, group, head_dim, dtype)
    scale = head_dim ** -0.5
    ours = cpu_kernels.paged_prefill_attention_cpu(q, kc, vc, tables, starts, ctx, scale)
    assert ours.dtype == dtype and ours.shape == q.shape
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, starts, ctx, scale)
    atol, rtol = prefill_tolerance(dtype)
    torch.testing.assert_close(ours.float(), ref, atol=atol, rtol=rtol)


@pytest.mark.skipif(not cpu_kernels.amx(), reason="no AMX on this CPU (or the OS refused this process its tiles)")
@pytest.mark.parametrize("kv_heads, group, head_dim", [(2, 7, 64), (4, 1, 32), (1, 8, 128), (2, 3, 96)])
def test_c_prefill_kernel_on_amx_tiles_matches_the_vector_tiles(kv_heads, group, head_dim):
    """bf16 with AMX: 16 rows a product (rows padded to 16, causal row groups skipped by 16), the
    scores of up to 4 x 16 keys and P x V in halves of 32 keys; against the reference, and
    against AVX512-BF16's vector tiles (the same sums up to their order)."""
    q, kc, vc, tables, starts, ctx = prefill_case(12, PREFILL_CHUNKS, kv_heads, group, head_dim, torch.bfloat16)
    scale = head_dim ** -0.5
    on_tiles = cpu_kernels.paged_prefill_attention_cpu(q, kc, vc, tables, starts, ctx, scale)
    try:
        assert not cpu_kernels.use_amx(False)
        on_vectors = cpu_kernels.paged_prefill_attention_cpu(q, kc, vc, tables, starts, ctx, scale)
    finally:
        cpu_kernels.use_amx(True)
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, starts, ctx, scale)
    atol, rtol = prefill_tolerance(torch.bfloat16)
    torch.testing.assert_close(on_tiles.float(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(on_tiles.float(), on_vectors.float(), atol=atol, rtol=rtol)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_prefill_kernel_strided_views_and_odd_shapes(dtype):
    """q a view into a fused qkv row, out a view into a wider buffer; block_size 5 (blocks and
    64-key tiles out of step), head_dim 80 (not a multiple of 64), an empty chunk."""
    chunks = [(0, 70), (23, 0), (61, 66), (3, 1)]
    q, kc, vc, tables, starts, ctx = prefill_case(8, chunks, 2, 3, 80, dtype, block=5)
    fused = torch.zeros(q.shape[0], q.shape[1] * 80 + 48, dtype=dtype)
    fused[:, 16:16 + q.shape[1] * 80] = q.reshape(q.shape[0], -1)
    qv = fused[:, 16:16 + q.shape[1] * 80].view(q.shape)
    wide = torch.full((q.shape[0], q.shape[1] * 80 + 32), 7.0, dtype=dtype)
    out = wide[:, :q.shape[1] * 80].view(q.shape)
    cpu_kernels.paged_prefill_attention_cpu(qv, kc, vc, tables, starts, ctx, 0.1, out=out)
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, starts, ctx, 0.1)
    atol, rtol = prefill_tolerance(dtype)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    assert torch.all(wide[:, q.shape[1] * 80:] == 7.0)  # nothing written past each row


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
def test_c_prefill_kernel_long_context_threads():
    """A 4k prompt, GQA 8 at head_dim 128, on 1 and 2 threads: identical results (each output
    row is computed by one task, in one order)."""
    q, kc, vc, tables, starts, ctx = prefill_case(9, [(0, 4096)], 1, 8, 128, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.paged_prefill_attention_cpu(q, kc, vc, tables, starts, ctx, 128 ** -0.5)
        torch.set_num_threads(2)
        two = cpu_kernels.paged_prefill_attention_cpu(q, kc, vc, tables, starts, ctx, 128 ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    # The reference on a sample of rows: row t is a decode over the first t + 1 positions.
    rows = torch.tensor([0, 1, 63, 64, 1000, 2047, 4095])
    ref = paged_decode_attention_ref(q[rows].float(), kc.float(), vc.float(), tables.expand(len(rows), -1),
                                     (rows + 1).to(torch.int32), 128 ** -0.5)
    torch.testing.assert_close(one[rows].float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
def test_c_prefill_kernel_rejects_bad_inputs():
    q, kc, vc, tables, starts, ctx = prefill_case(10, [(20, 12)], 2, 2, 64)
    call = cpu_kernels.paged_prefill_attention_cpu
    with pytest.raises(ValueError, match="dtype"):
        call(q, kc.double(), vc, tables, starts, ctx, 0.1)
    with pytest.raises(ValueError, match="query heads"):
        call(q[:, :3], kc, vc, tables, starts, ctx, 0.1)
    with pytest.raises(ValueError, match="multiple of 16"):
        call(q[..., :40], kc[..., :40].contiguous(), vc[..., :40].contiguous(), tables, starts, ctx, 0.1)
    with pytest.raises(ValueError, match="more new tokens than context"):
        call(q, kc, vc, tables, starts, torch.tensor([11], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="block table"):
        call(q, kc, vc, tables[:, :1], starts, ctx, 0.1)
    with pytest.raises(ValueError, match="past the query"):
        call(q[:5], kc, vc, tables, starts, ctx, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        call(q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, tables, starts, ctx, 0.1)
    with pytest.raises(ValueError, match="scale"):
        call(q, kc, vc, tables, starts, ctx, 0.0)
    torch.testing.assert_close(call(q, kc, vc, tables, starts, ctx, 0.1),  # still fine after all that
                               paged_prefill_attention_ref(q, kc, vc, tables, starts, ctx, 0.1), atol=ATOL, rtol=0)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.parametrize("flags", [["-O2"], ["-O2", "-mavx2", "-mfma"],
                                   ["-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]],
                         ids=["plain-c", "avx2", "avx512-no-bf16"])
def test_c_prefill_kernel_fallbacks(flags, tmp_path):
    """The builds for CPUs without AVX2 (plain C), with AVX2 but no AVX-512 (8-lane tiles) and
    without AVX512-BF16 (bf16 widened to the fp32 tiles), compiled here and called directly."""
    cpu_flags = Path("/proc/cpuinfo").read_text().split()
    if "-mavx512f" in flags and "avx512f" not in cpu_flags:
        pytest.skip("no AVX-512 on this CPU")
    if "-mavx2" in flags and not {"avx2", "fma"} <= set(cpu_flags):
        pytest.skip("no AVX2 and FMA on this CPU")
    src = Path(cpu_kernels.__file__).with_name("prefill_attention.c")
    so = tmp_path / "prefill.so"
    subprocess.run(["gcc", *flags, "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    p, i, n, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        fn = getattr(lib, f"strata_prefill_attention_{suffix}")
        fn.restype, fn.argtypes = ctypes.c_int, [p, n, p, p, p, i, p, p, p, n, i, i, i, i, i, f, i]
        q, kc, vc, tables, starts, ctx = prefill_case(11, [(0, 37), (45, 19), (70, 70)], 2, 4, 48, dtype)
        out = torch.empty_like(q)
        assert fn(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), tables.shape[1],
                  starts.data_ptr(), ctx.data_ptr(), out.data_ptr(), out.stride(0), 3, 8, 2, 48, BLOCK, 0.2, 2) == 0
        ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, starts, ctx, 0.2)
        atol, rtol = prefill_tolerance(dtype)
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_uses_c_kernel_and_matches_sdpa_path(dtype, monkeypatch):
    """TorchAttention._prefill calls the kernel for CPU fp32/bf16 where the CPU has AVX-512 or AVX2
    (SDPA elsewhere: prefill_kernel_vectorized), and the kernel agrees with the SDPA path."""
    chunks = [(0, 40), (32, 21), (45, 19)]
    q, kc, vc, tables, starts, ctx = prefill_case(12, chunks, 2, 7, 64, dtype)
    ctx_host, qlens = ctx.tolist(), [n for _, n in chunks]
    knew = torch.cat([kc[tables[b].long()].reshape(-1, 2, 64)[c - n:c] for b, (c, n) in enumerate(zip(ctx_host, qlens))])
    vnew = torch.cat([vc[tables[b].long()].reshape(-1, 2, 64)[c - n:c] for b, (c, n) in enumerate(zip(ctx_host, qlens))])
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), 0, empty.view(0, 0), empty, sum(qlens),
                             tables, starts, ctx, qlens, ctx_host)
    attn = TorchAttention(14, 2, 64, 0.125)
    assert attn.prefill_kernel == cpu_kernels.prefill_kernel_vectorized()
    attn.prefill_kernel = True  # the kernel's plain C loops are checked on any CPU
    calls = []
    real = cpu_kernels.paged_prefill_attention_cpu
    monkeypatch.setattr(cpu_kernels, "paged_prefill_attention_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ours = torch.empty_like(q)
    attn._prefill(q, knew, vnew, kc, vc, meta, ours)
    assert calls == [1]
    attn.cpu_kernels = attn.prefill_kernel = False
    sdpa = torch.empty_like(q)
    attn._prefill(q, knew, vnew, kc, vc, meta, sdpa)
    atol, rtol = prefill_tolerance(dtype)
    torch.testing.assert_close(ours.float(), sdpa.float(), atol=atol if dtype == torch.float32 else 2e-2, rtol=rtol)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
def test_prefill_kernel_path_copies_odd_layouts():
    """_prefill with a query whose heads are not contiguous and an out view of the same kind:
    the kernel path copies in and out rather than failing."""
    chunks = [(16, 20)]
    q, kc, vc, tables, starts, ctx = prefill_case(13, chunks, 2, 2, 64)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [tokens, heads, dim], dim stride = heads
    buf = torch.zeros(q.shape[0], 64, 4)
    out = buf.transpose(1, 2)
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), 0, empty.view(0, 0), empty, 20, tables, starts, ctx,
                             [20], [36])
    TorchAttention(4, 2, 64, 0.125)._prefill(qt, None, None, kc, vc, meta, out)
    torch.testing.assert_close(out, paged_prefill_attention_ref(q, kc, vc, tables, starts, ctx, 0.125),
                               atol=ATOL, rtol=0)
