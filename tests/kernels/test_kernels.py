"""Triton kernels vs their plain-torch references (and vs transformers where relevant).

Device: ``STRATA_KERNEL_DEVICE`` (``cpu`` or ``cuda``; conftest.py defaults it to
``cuda`` when available). On CPU the kernels run under the Triton interpreter, so
shapes are small; on CUDA the same tests run compiled, without the interpreter.
"""

import os

# Must precede any triton import: triton.jit picks the interpreter at decoration time.
if os.environ.get("STRATA_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels as K

DEVICE = os.environ.get("STRATA_KERNEL_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"STRATA_KERNEL_DEVICE={DEVICE} but CUDA is not available", allow_module_level=True)

# Tolerances per dtype (torch.testing.assert_close: |out - ref| <= atol + rtol * |ref|).
# References compute in fp32 from the same (rounded) inputs; 16-bit errors come from
# rounding the output and, in attention, the probabilities before P @ V (as on GPUs).
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = list(TOL)
BLOCK_SIZE = 16
NUM_KV_HEADS = 2

dtype_ids = lambda d: str(d).replace("torch.", "")  # noqa: E731


def cdiv(a, b):
    return -(-a // b)


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype == dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def assert_same_rounding(out, expect, dtype):
    """Exact equality of a value computed in fp32 and rounded once to ``dtype``.

    Exception: the Triton interpreter converts fp32 -> bf16 by truncation (seen with
    triton 3.9; compiled kernels round to nearest even), so on CPU bf16 may be 1 ulp off.
    """
    assert out.dtype == expect.dtype == dtype
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(out.float(), expect.float(), atol=0, rtol=2**-7)
    else:
        assert torch.equal(out, expect)


def randn(*shape, dtype=torch.float32, gen=None, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def make_paged_kv(lens, head_dim, dtype, num_kv_heads=NUM_KV_HEADS, spare_blocks=5, seed=0):
    """Paged K/V caches holding sequences of the given lengths.

    Blocks come from a random permutation (a sequence's blocks are neither
    contiguous nor in order), unused block-table entries are -1, and every cache
    entry that is not a valid token (spare blocks, the tail of each last block) is
    NaN: a kernel that reads past a context, through an unused table entry or
    multiplies a masked probability by such a value produces NaN and fails.
    """
    gen = torch.Generator().manual_seed(seed)
    nblocks = [cdiv(n, BLOCK_SIZE) for n in lens]
    num_blocks = sum(nblocks) + spare_blocks
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(nblocks) + 2), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        ids = perm[used : used + nblocks[b]]
        used += nblocks[b]
        tables[b, : nblocks[b]] = ids.int()
        pos = torch.arange(n)
        k[ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v[ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    return k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), tables.to(DEVICE)


def slots_for(tables, b, positions):
    tables = tables.cpu()
    return [int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def dense_causal(q, k, v, scale):
    """Plain causal attention, q/k/v ``[seq, heads, D]`` (k/v with KV heads), fp32 result."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


# ----------------------------------------------------------------------------
# store_kv_cache
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=dtype_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_store_kv_cache(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, head_dim, num_tokens, hq = 6, 64, 13, 4
    k_cache = randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype=dtype, gen=gen)
    # key/value as strided views into a fused qkv projection output, as the engine has them.
    qkv = randn(num_tokens, (hq + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype, gen=gen)
    kv = hq * head_dim
    key = qkv[:, kv : kv + NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    value = qkv[:, kv + NUM_KV_HEADS * head_dim :].view(num_tokens, NUM_KV_HEADS, head_dim)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding tokens
    slots = slots.to(slot_dtype).to(DEVICE)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    K.store_kv_cache_ref(key, value, k_ref, v_ref, slots)
    before = k_cache.clone()
    K.store_kv_cache(key, value, k_cache, v_cache, slots)
    assert not torch.equal(before, k_cache)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    # A written slot holds its token; padding tokens were written nowhere.
    s0 = int(slots[0])
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, head_dim)[s0], key[0])
    flat = k_cache.view(-1, NUM_KV_HEADS, head_dim)
    assert not (flat == key[2]).all(dim=(1, 2)).any()


# ----------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------

DECODE_LENS = [1, 17, 50, 97]  # none a multiple of BLOCK_SIZE except via the 1-token case


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_paged_decode_attention(dtype, head_dim, group, num_splits):
    """Splits 3 and 8 leave partial last splits (97 tokens -> 48/48/1 or 6x16 + 1)
    and empty trailing splits for the short sequences."""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables = make_paged_kv(DECODE_LENS, head_dim, dtype)
    ctx = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    q = randn(len(DECODE_LENS), NUM_KV_HEADS * group, head_dim, dtype=dtype, gen=gen, scale=2.0)
    scale = head_dim**-0.5
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=num_splits)
    ref = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_paged_decode_attention_auto_splits(dtype):
    lens = [300, 5]
    k_cache, v_cache, tables = make_paged_kv(lens, 64, dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(2, NUM_KV_HEADS * 2, 64, dtype=dtype, gen=torch.Generator().manual_seed(3), scale=2.0)
    bound = tables.shape[1] * BLOCK_SIZE
    assert K.choose_num_splits(2, NUM_KV_HEADS, bound, q.device) > 1  # the merge path is taken
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125)
    assert_close(out, K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.125), dtype)
    out2 = K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, max_context_len=300)
    assert_close(out2, out, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_attention_empty_context(num_splits):
    """Context length 0 (e.g. CUDA-graph padding rows) gives zeros, not NaN."""
    lens = [0, 21]
    k_cache, v_cache, tables = make_paged_kv(lens, 64, torch.float32)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(2, 4, 64)
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.125), torch.float32)


def test_choose_num_splits():
    dev = torch.device(DEVICE)
    choose = K.choose_num_splits
    assert choose(256, 8, 32768, dev) == 1  # big batch fills the machine alone
    assert choose(1, 8, 200, dev) == 1  # short context: not worth a merge
    long_small = choose(1, 8, 32768, dev)
    assert long_small > 1 and long_small & (long_small - 1) == 0 and long_small <= 64
    assert choose(1, 8, 32768, dev) >= choose(4, 8, 32768, dev) >= choose(64, 8, 32768, dev)
    assert choose(1, 8, 32768, dev) >= choose(1, 8, 2048, dev)


def test_decode_ref_matches_prefill_ref():
    """The two references agree on a 1-token chunk (checks the references themselves)."""
    lens = [7, 40]
    k_cache, v_cache, tables = make_paged_kv(lens, 64, torch.float32)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(2, 8, 64)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    a = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.1)
    b = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, ctx, 0.1)
    torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------
# prefill / extend
# ----------------------------------------------------------------------------

# (cached prefix, new tokens): plain prefill, block-aligned prefix + chunk,
# unaligned prefix (a chunk in the middle of a long prompt), a single new token.
PREFILL_SEQS = [(0, 37), (32, 21), (45, 19), (29, 1)]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_paged_prefill_attention(dtype, head_dim, group):
    gen = torch.Generator().manual_seed(4)
    ctx_lens = [p + n for p, n in PREFILL_SEQS]
    k_cache, v_cache, tables = make_paged_kv(ctx_lens, head_dim, dtype)
    q_lens = [n for _, n in PREFILL_SEQS]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    q = randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, gen=gen, scale=2.0)
    scale = head_dim**-0.5
    out = K.paged_prefill_attention(q, k_cache, v_cache, tables, qsl, ctx, scale)
    ref = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, ctx, scale)
    assert_close(out, ref, dtype)


def test_prefill_ref_matches_sdpa():
    """Plain prefill through the reference equals dense causal SDPA (checks the reference)."""
    lens = [29]
    k_cache, v_cache, tables = make_paged_kv(lens, 64, torch.float32)
    q = randn(29, 8, 64)
    qsl = torch.tensor([0, 29], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, ctx, 0.125)
    k = k_cache[tables[0, :2].long()].reshape(-1, NUM_KV_HEADS, 64)[:29]
    v = v_cache[tables[0, :2].long()].reshape(-1, NUM_KV_HEADS, 64)[:29]
    torch.testing.assert_close(ref, dense_causal(q, k, v, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_chunked_prefill_then_decode_end_to_end(dtype):
    """store_kv_cache + chunked prefill + decode on a fresh (NaN) cache equal dense
    causal attention over the whole sequences.

    Sequence A (45-token prompt) is prefilled in chunks of 20, 16, 9; sequence B
    (30 tokens) in one chunk packed with A's first chunk; then both decode one token.
    """
    gen = torch.Generator().manual_seed(5)
    head_dim, group, num_blocks = 64, 2, 12
    hq = NUM_KV_HEADS * group
    full = {"A": 46, "B": 31}
    seq_q = {s: randn(n, hq, head_dim, dtype=dtype, gen=gen, scale=2.0) for s, n in full.items()}
    seq_k = {s: randn(n, NUM_KV_HEADS, head_dim, dtype=dtype, gen=gen) for s, n in full.items()}
    seq_v = {s: randn(n, NUM_KV_HEADS, head_dim, dtype=dtype, gen=gen) for s, n in full.items()}
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((2, 4), -1, dtype=torch.int32)
    tables[0, :3] = perm[:3].int()
    tables[1, :2] = perm[3:5].int()
    tables = tables.to(DEVICE)
    scale = head_dim**-0.5
    row = {"A": 0, "B": 1}
    got = {"A": [], "B": []}

    def step(chunks):  # chunks: list of (seq, start, end), all packed in one launch
        seqs = [s for s, _, _ in chunks]
        q = torch.cat([seq_q[s][a:e] for s, a, e in chunks])
        key = torch.cat([seq_k[s][a:e] for s, a, e in chunks])
        val = torch.cat([seq_v[s][a:e] for s, a, e in chunks])
        slots = sum((slots_for(tables, row[s], range(a, e)) for s, a, e in chunks), [])
        # Two padding tokens at the end, as a CUDA-graph-padded batch would have.
        key = torch.cat([key, randn(2, NUM_KV_HEADS, head_dim, dtype=dtype, gen=gen)])
        val = torch.cat([val, randn(2, NUM_KV_HEADS, head_dim, dtype=dtype, gen=gen)])
        slots = torch.tensor(slots + [-1, -1], dtype=torch.int64, device=DEVICE)
        K.store_kv_cache(key, val, k_cache, v_cache, slots)
        bt = tables[[row[s] for s in seqs]]
        ctx = torch.tensor([e for _, _, e in chunks], dtype=torch.int32, device=DEVICE)
        if all(e - a == 1 for _, a, e in chunks):
            out = K.paged_decode_attention(q, k_cache, v_cache, bt, ctx, scale, num_splits=2)
            ref = K.paged_decode_attention_ref(q, k_cache, v_cache, bt, ctx, scale)
        else:
            lens = [e - a for _, a, e in chunks]
            qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
            out = K.paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, scale)
            ref = K.paged_prefill_attention_ref(q, k_cache, v_cache, bt, qsl, ctx, scale)
        assert_close(out, ref, dtype)
        n = 0
        for s, a, e in chunks:
            got[s].append(out[n : n + e - a])
            n += e - a

    step([("A", 0, 20), ("B", 0, 30)])
    step([("A", 20, 36)])
    step([("A", 36, 45)])
    step([("A", 45, 46), ("B", 30, 31)])
    for s in ("A", "B"):
        out = torch.cat(got[s])
        expect = dense_causal(seq_q[s], seq_k[s], seq_v[s], scale).to(dtype)
        assert_close(out, expect, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_ids)
def test_attention_with_gpu_tile_sizes(dtype, monkeypatch):
    """Decode and prefill with the tile sizes the GPU launch uses (64-token tiles,
    64-row prefill tiles), which the CPU runs above otherwise replace by 16."""
    import kernels.attention as attention

    monkeypatch.setitem(attention._DECODE_BLOCK_N, "cpu", attention._DECODE_BLOCK_N["cuda"])
    monkeypatch.setitem(attention._PREFILL_BLOCKS, "cpu", attention._PREFILL_BLOCKS["cuda"])
    gen = torch.Generator().manual_seed(10)
    ctx_lens = [p + n for p, n in PREFILL_SEQS] + [150]
    q_lens = [n for _, n in PREFILL_SEQS] + [70]
    k_cache, v_cache, tables = make_paged_kv(ctx_lens, 128, dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    q = randn(sum(q_lens), NUM_KV_HEADS * 4, 128, dtype=dtype, gen=gen, scale=2.0)
    out = K.paged_prefill_attention(q, k_cache, v_cache, tables, qsl, ctx, 0.09)
    assert_close(out, K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, ctx, 0.09), dtype)
    qd = q[: len(ctx_lens)].contiguous()
    for splits in (1, 2):
        out = K.paged_decode_attention(qd, k_cache, v_cache, tables, ctx, 0.09, num_splits=splits)
        assert_close(out, K.paged_decode_attention_ref(qd, k_cache, v_cache, tables, ctx, 0.09), dtype)


def test_kernels_compile_for_gpu():
    """Compile each kernel for sm_90 with Triton's compiler (no GPU needed), catching
    errors the interpreter cannot see; see aot_compile_check.py."""
    script = Path(__file__).with_name("aot_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(script), "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout


# ----------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_rms_norm(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(6)
    x = randn(7, hidden, dtype=dtype, gen=gen, scale=3.0)
    w = randn(hidden, dtype=dtype, gen=gen)
    res = randn(7, hidden, dtype=dtype, gen=gen) if with_residual else None
    x0 = x.clone()
    res0 = res.clone() if with_residual else None
    out = K.rms_norm(x, w, 1e-6, res)
    ref = K.rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(x, x0)  # inputs untouched
    if with_residual:
        assert torch.equal(res, res0)
        assert_close(out[0], ref[0], dtype)
        assert_same_rounding(out[1], ref[1], dtype)  # x + residual, rounded once
        assert_same_rounding(out[1], x + res, dtype)
    else:
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_ids)
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(7)
    x = randn(5, 128, dtype=dtype, gen=gen, scale=2.0)
    res = randn(5, 128, dtype=dtype, gen=gen)
    norm = LlamaRMSNorm(128, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(128, generator=gen))
    norm = norm.to(dtype)
    with torch.no_grad():
        expect = norm(x + res)
    out, new_res = K.rms_norm(x, norm.weight.detach(), 1e-5, res)
    assert_close(out, expect, dtype)
    assert_same_rounding(new_res, x + res, dtype)


# ----------------------------------------------------------------------------
# rotary embedding
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_rotary_embedding(dtype, head_dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(8)
    hq, num_tokens = 4, 9
    cache = K.compute_cos_sin_cache(head_dim, 256, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 1, 5, 17, 100, 255, 3, 3, 42], dtype=torch.int64, device=DEVICE)
    q = randn(num_tokens, hq, head_dim, dtype=dtype, gen=gen)
    k = randn(num_tokens, NUM_KV_HEADS, head_dim, dtype=dtype, gen=gen)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = K.rotary_embedding(positions, q, k, cache, head_dim)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    q_ref, k_ref = K.rotary_embedding_ref(positions, q, k, cache, head_dim)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)

    # Hugging Face Llama: cos/sin of shape [tokens, head_dim] (the half table repeated).
    half = head_dim // 2
    cos = cache[positions][:, :half].repeat(1, 2)
    sin = cache[positions][:, half:].repeat(1, 2)
    q_hf, k_hf = apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=1)
    assert_close(q_out, q_hf.to(dtype), dtype)
    assert_close(k_out, k_hf.to(dtype), dtype)

    # Flattened [tokens, heads * head_dim] strided views of a fused qkv output.
    qkv = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), k.reshape(num_tokens, -1)], dim=1)
    q_view = qkv[:, : hq * head_dim]
    k_view = qkv[:, hq * head_dim : (hq + NUM_KV_HEADS) * head_dim]
    q2, k2 = K.rotary_embedding(positions, q_view, k_view, cache, head_dim)
    assert q2.shape == q_view.shape and k2.shape == k_view.shape
    assert torch.equal(q2.view_as(q_out), q_out)
    assert torch.equal(k2.view_as(k_out), k_out)


def _hf_llama_config(head_dim, base, scaling):
    from transformers import LlamaConfig

    common = dict(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4,
                  head_dim=head_dim, max_position_embeddings=32768)
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        params = {"rope_type": "default"} if scaling is None else dict(scaling)
        params["rope_theta"] = base
        return LlamaConfig(**common, rope_parameters=params)
    return LlamaConfig(**common, rope_theta=base, rope_scaling=scaling)


ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_cos_sin_cache_matches_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = ROPE_SCALINGS[name]
    head_dim, base, max_pos = 128, 500000.0, 20000
    ours = K.compute_cos_sin_cache(head_dim, max_pos, base, scaling)
    assert ours.shape == (max_pos, head_dim) and ours.dtype == torch.float32
    cfg = _hf_llama_config(head_dim, base, scaling)
    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(torch.zeros(1), torch.arange(max_pos)[None])
    half = head_dim // 2
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half], atol=1e-5, rtol=0)
    if name in ROPE_INIT_FUNCTIONS and name != "yarn":  # yarn also scales cos/sin magnitudes
        # The inverse frequencies themselves (angle at position 1).
        inv_freq = ROPE_INIT_FUNCTIONS[name](cfg, "cpu")[0]
        torch.testing.assert_close(torch.atan2(ours[1, half:], ours[1, :half]), inv_freq, atol=0, rtol=1e-6)
    if scaling is not None:
        assert not torch.allclose(ours, K.compute_cos_sin_cache(head_dim, max_pos, base))


def test_cos_sin_cache_dynamic_not_supported():
    with pytest.raises(ValueError):
        K.compute_cos_sin_cache(64, 16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


# ----------------------------------------------------------------------------
# silu_and_mul
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 1500])  # 1500: two column tiles, a partial one
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_silu_and_mul(dtype, d):
    gen = torch.Generator().manual_seed(9)
    x = randn(5, 2 * d, dtype=dtype, gen=gen, scale=3.0)
    out = K.silu_and_mul(x)
    assert out.shape == (5, d)
    assert_close(out, K.silu_and_mul_ref(x), dtype)
    expect = (F.silu(x[:, :d].float()) * x[:, d:].float()).to(dtype)
    assert_close(out, expect, dtype)
    x3 = x.view(5, 1, 2 * d)
    assert torch.equal(K.silu_and_mul(x3), out.view(5, 1, d))


# ----------------------------------------------------------------------------
# CUDA only
# ----------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
def test_decode_step_is_cuda_graph_capturable():
    """The decode launchers never synchronize, so a step can be captured and replayed."""
    lens = [40, 97, 5]
    k_cache, v_cache, tables = make_paged_kv(lens, 128, torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(3, 8, 128, dtype=torch.bfloat16)
    x = randn(3, 512, dtype=torch.bfloat16)
    w = randn(512, dtype=torch.bfloat16)
    for _ in range(2):  # warm up / compile outside the capture
        K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
        K.rms_norm(x, w, 1e-6, x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
        normed, _ = K.rms_norm(x, w, 1e-6, x)
    q.copy_(randn(3, 8, 128, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.1), torch.bfloat16)
    assert_close(normed, K.rms_norm_ref(x, w, 1e-6, x)[0], torch.bfloat16)
