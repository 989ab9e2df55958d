"""Paged-KV attention kernels: cache write, flash-decoding, chunked prefill.

KV cache layout (fixed, the engine relies on it): per layer ``k_cache`` and
``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``,
contiguous. Token at logical position ``p`` of a sequence lives in physical
block ``block_table[p // block_size]`` at offset ``p % block_size``; slot =
``block_id * block_size + offset``. Block-table entries past a sequence's
length are never read (every gather is masked), so they may hold garbage.

GQA: query head ``j`` uses KV head ``j // group`` (``group = Hq // Hkv``), as in
HF ``repeat_kv``. Every attention program owns one KV head and all of its
``group`` query heads, so each K/V tile is read from memory once per KV head.

fp8 caches (kv_cache_dtype=fp8): every kernel also takes ``k_scales``/``v_scales``,
fp32 ``[num_blocks, block_size, num_kv_heads]``, a scale per token and KV head; a
cached row is ``fp8 * scale`` (the store kernel picks ``scale = max|row| / 448``),
widened to the query's dtype as each tile is loaded.

All launchers avoid host<->device synchronization (no ``.item()``), so they can
be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import check_device, dot_in_fp32, next_pow2, num_sms

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3 value


@triton.jit
def _mma(a, b, FP32: tl.constexpr):
    # FP32: upcast and use exact fp32 products (fp32 inputs, or the interpreter
    # whose bf16 tl.dot is broken); otherwise native 16-bit tensor-core dot.
    if FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


# ----------------------------------------------------------------------------
# store_kv_cache
# ----------------------------------------------------------------------------


@triton.jit
def _store_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    num_heads, head_dim,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # -1 marks a padding token
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if SCALED:  # fp8: a scale per (token, head) that maps the row's largest value to FP8_MAX
        h_mask = offs_h < num_heads
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        ks = tl.max(tl.abs(k), 1) / FP8_MAX
        vs = tl.max(tl.abs(v), 1) / FP8_MAX
        ks = tl.where(ks > 0.0, ks, 1.0)
        vs = tl.where(vs > 0.0, vs, 1.0)
        k = _round_to_e4m3(k / ks[:, None])
        v = _round_to_e4m3(v / vs[:, None])
        tl.store(k_scale_ptr + slot * num_heads + offs_h, ks, mask=h_mask)
        tl.store(v_scale_ptr + slot * num_heads + offs_h, vs, mask=h_mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value (ties to even), so that the
    conversion to fp8 is exact: normal values keep 3 mantissa bits (rounding on the bits carries
    into the exponent), subnormal ones (|x| < 2^-6) become multiples of 2^-9. (The Triton
    interpreter's own fp32 -> fp8 rounding loses that carry: 124.3 became 64.)"""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # clear the low 20 of 23 mantissa bits
    sub = tl.floor(x * 512.0 + 0.5) / 512.0
    return tl.where(tl.abs(x) < 0.015625, sub, bits.to(tl.float32, bitcast=True))


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None) -> None:
    """Write ``key[i]``/``value[i]`` (``[num_tokens, num_kv_heads, head_dim]``) into
    slot ``slot_mapping[i]`` of the paged caches, in place. Slots equal to -1 are
    skipped. key/value may be strided views (e.g. slices of a fused qkv output)
    as long as the last dim is contiguous; values are cast to the cache dtype."""
    check_device(k_cache)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    scaled = _check_scales(k_cache, k_scales, v_scales)
    _store_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scales if scaled else slot_mapping,
        v_scales if scaled else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, head_dim,
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim), SCALED=scaled,
        num_warps=4,
    )


def _check_scales(k_cache, k_scales, v_scales) -> bool:
    """Whether the caches come with per-(token, KV head) scales (fp8 caches); checks them."""
    if k_scales is None and v_scales is None:
        return False
    for sc in (k_scales, v_scales):
        assert sc is not None and sc.dtype == torch.float32 and sc.is_contiguous() and sc.shape == k_cache.shape[:3]
    return True


# ----------------------------------------------------------------------------
# decode (flash-decoding: split-KV partials + log-sum-exp merge)
# ----------------------------------------------------------------------------


@triton.jit
def _widen(x, scale_ptr, slots, kvh, num_kv_heads, n_mask, dtype: tl.constexpr, AXIS: tl.constexpr):
    """An fp8 K ([D, N], AXIS 0) or V ([N, D], AXIS 1) tile times its rows' scales, in `dtype`."""
    sc = tl.load(scale_ptr + slots * num_kv_heads + kvh, mask=n_mask, other=0.0)
    if AXIS == 0:
        out = x.to(tl.float32) * sc[None, :]
    else:
        out = x.to(tl.float32) * sc[:, None]
    return out.to(dtype)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    head_dim,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr, DOT_FP32: tl.constexpr, SCALED: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)

    ctx = tl.load(context_lens_ptr + b)
    # Each sequence's own length is cut into num_splits equal, tile-aligned
    # parts, so work is balanced per sequence; trailing parts may be empty.
    per_split = (ctx + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    head = kvh * GROUP + offs_g

    # Padded group rows load zeros: their scores are 0 (finite), they are
    # never stored, and they keep the tl.dot M dimension >= 16.
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
        # K loaded transposed ([D, N]) so the score tile is a plain dot.
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        if SCALED:
            k = _widen(k, k_scale_ptr, blk * PAGE_SIZE + pos % PAGE_SIZE, kvh, num_kv_heads, n_mask, q.dtype, 0)
        s = _mma(q, k, DOT_FP32) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile has >= 1 valid token, so m_new is finite from the first tile.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if SCALED:
            v = _widen(v, v_scale_ptr, blk * PAGE_SIZE + pos % PAGE_SIZE, kvh, num_kv_heads, n_mask, q.dtype, 1)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    store_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        # Single split: normalize here and skip the merge launch.
        # Empty context (CUDA-graph padding rows) -> l == 0 -> output 0.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Partials are [batch, Hq, num_splits, (D)] contiguous fp32.
        row = (b * (num_kv_heads * GROUP) + head).to(tl.int64) * num_splits + split
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :], acc, mask=store_mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    num_splits, stride_ob, stride_oh, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    row = (b * num_heads + h).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    # All splits empty (context length 0): avoid -inf - -inf = nan, output 0.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits have m = -inf -> weight 0
    denom = tl.sum(w * l, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


# Tile sizes. The interpreter (CPU) uses the smallest tiles tl.dot accepts so
# short test contexts still cross several tiles and splits.
_DECODE_BLOCK_N = {"cuda": 64, "cpu": 16}
_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 256


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Number of KV partitions per sequence for flash-decoding.

    Aim for about two waves of programs over the SMs, but never give a split
    fewer than ~256 tokens (below that the merge costs more than it gains).
    Rounded down to a power of two to bound the number of merge-kernel variants.
    Small batch + long context -> many splits; large batch -> 1 (no merge launch).
    """
    base = max(1, batch * num_kv_heads)
    want = -(-2 * num_sms(device) // base)
    cap = -(-max(1, max_context_len) // _MIN_TOKENS_PER_SPLIT)
    n = max(1, min(want, cap, _MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: Optional[int] = None,
    max_context_len: Optional[int] = None,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode attention: ``query [batch, Hq, D]`` (one token per sequence) over the
    first ``context_lens[b]`` cached tokens (which include the token itself).

    ``num_splits=None`` picks the split count with :func:`choose_num_splits` from
    the batch size and ``max_context_len``; when that is not given, the block
    table width (``block_tables.shape[1] * block_size``) is used as the bound, so
    the launch never reads ``context_lens`` on the host (CUDA-graph safe).
    Sequences with context length 0 produce zeros. Returns ``[batch, Hq, D]`` in
    the query dtype.
    """
    check_device(query)
    batch, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads and query.stride(-1) == 1
    out = torch.empty((batch, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    dev = "cuda" if query.is_cuda else "cpu"
    if num_splits is None:
        bound = max_context_len if max_context_len is not None else block_tables.shape[1] * page_size
        num_splits = choose_num_splits(batch, num_kv_heads, bound, query.device)
    direct = num_splits == 1
    if direct:
        part_acc = part_m = part_l = out  # unused placeholders
    else:
        part_acc = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_m = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    block_d = next_pow2(head_dim)
    scaled = _check_scales(k_cache, k_scales, v_scales)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scales if scaled else out, v_scales if scaled else out, block_tables, context_lens,
        out, part_acc, part_m, part_l,
        scale * LOG2E, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        GROUP=group, PAGE_SIZE=page_size,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=_DECODE_BLOCK_N[dev], BLOCK_D=block_d,
        DIRECT=direct, DOT_FP32=dot_in_fp32(query), SCALED=scaled,
        num_warps=4, num_stages=2,
    )
    if not direct:
        _decode_merge_kernel[(batch, num_q_heads)](
            out, part_acc, part_m, part_l,
            num_splits, out.stride(0), out.stride(1), head_dim,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
            num_warps=4,
        )
    return out


# ----------------------------------------------------------------------------
# prefill / extend (chunked prefill, prefix caching)
# ----------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, query_start_loc_ptr,
    context_lens_ptr, out_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    head_dim,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, SCALED: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)

    # Map the flat program id to (sequence, query tile) without any host sync:
    # sequence b owns program ids [qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1),
    # always >= cdiv(q_len_b, BLOCK_Q) of them; binary-search for b.
    # Loop-carried bounds start as i32 tensors (num_seqs == 1 would otherwise be
    # specialized to a constexpr and change type inside the loop).
    lo = pid * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + b)
    if q_tile * BLOCK_Q >= q_len:
        return

    ctx = tl.load(context_lens_ptr + b)
    prefix = ctx - q_len  # absolute position of the chunk's first token

    # Rows are (query token, head within the KV group) pairs, group-minor, so
    # one K/V tile serves every query head of this KV head.
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = q_tile * BLOCK_Q + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    row_mask = (tok < q_len) & (g < GROUP)
    d_mask = offs_d < head_dim
    head = kvh * GROUP + g
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    # Causal: nothing past the tile's last query position is needed.
    kv_end = tl.minimum(ctx, prefix + (q_tile + 1) * BLOCK_Q)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_end
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        if SCALED:
            k = _widen(k, k_scale_ptr, blk * PAGE_SIZE + pos % PAGE_SIZE, kvh, num_kv_heads, n_mask, q.dtype, 0)
        s = _mma(q, k, DOT_FP32) * scale_log2
        # Position 0 is visible to every row (q_pos >= 0), so each row's running
        # max is finite after the first tile; fully masked rows later are fine.
        s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if SCALED:
            v = _widen(v, v_scale_ptr, blk * PAGE_SIZE + pos % PAGE_SIZE, kvh, num_kv_heads, n_mask, q.dtype, 1)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


_PREFILL_BLOCKS = {"cuda": (64, 64), "cpu": (16, 16)}  # (BLOCK_M rows, BLOCK_N keys)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Extend/prefill attention over the paged cache (chunked prefill, prefix caching).

    ``query [total_new_tokens, Hq, D]`` packs the new tokens of each sequence
    (rows ``query_start_loc[b]:query_start_loc[b+1]``); ``context_lens[b]`` counts
    the sequence's tokens in the cache *after* this chunk was written. New token
    ``i`` of a chunk of ``q_len`` sits at ``context_lens[b] - q_len + i`` and
    attends causally to every cache position ``<=`` it. Returns ``[total, Hq, D]``
    in the query dtype.
    """
    check_device(query)
    total, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads and query.stride(-1) == 1
    out = torch.empty((total, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = context_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    block_m, block_n = _PREFILL_BLOCKS["cuda" if query.is_cuda else "cpu"]
    block_g = next_pow2(group)
    block_m = max(block_m, block_g)
    block_q = block_m // block_g
    # Upper bound on query tiles (see the kernel's sequence search).
    grid = (total // block_q + num_seqs, num_kv_heads)
    scaled = _check_scales(k_cache, k_scales, v_scales)
    _prefill_kernel[grid](
        query, k_cache, v_cache, k_scales if scaled else out, v_scales if scaled else out, block_tables,
        query_start_loc, context_lens, out,
        scale * LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        GROUP=group, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim), DOT_FP32=dot_in_fp32(query), SCALED=scaled,
        num_warps=4, num_stages=2,
    )
    return out
