"""The sampler's steps on the device (services/engine/sampler.py, off the CPU): one launch for
the penalized rows' seen values, one for the step's top-k rows, one for its whole rows, one for
the logprob rows' log-sum-exp, where the same steps in torch ops take about 6, 20, 30 and 3 per 8
rows (each launch a few microseconds of host time while the GPU waits).

The draws follow the sampler's semantics exactly (its module docstring): the kept set is an
intersection of thresholds on the scaled logits (top-k: the k-th value, ties kept; top-p: the
value of the token whose prefix mass crosses top_p, ties kept; min-p: min_p times the largest
probability), and each draw is one uniform per row and round, read from the step's table. Their
sums run in another order than torch's, so a draw on a boundary can land one token apart.

- `log_sum_exp`: each row's log-sum-exp in fp32, one pass over the row in its own dtype.
- `penalized_values`: the penalized rows' seen ids, gathered from the logits and penalized:
  repetition (transformers), then frequency and presence (OpenAI), in fp32.
- `sample_candidates`: rows with top-k, from their largest values (one torch topk, sorted
  descending, k + tie room wide). Temperature, the k-th value, top-p over the kept candidates,
  min-p and the inverse-CDF draw, one program a row. A row whose ties with the k-th value run
  past its candidates is flagged, as on the torch path, for the exact slow path.
- `sample_whole_rows`: rows without top-k, over the whole vocabulary, one program a row looping
  over it: w = exp((logit - max) / T), the unnormalized probabilities; top-p by rejection
  against a rising pivot (draw from w above the pivot, accept when the mass strictly above the
  token is below top_p, else raise the pivot to it), `rounds` rounds, then the row is flagged
  pending for the exact sort. Each pass recomputes w from the logits (no fp32 copy of the rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_device, next_pow2

NEG_INF = tl.constexpr(float("-inf"))
WHOLE_ROW_BLOCK = 2048  # vocabulary entries a whole-row program reads at once
# The largest fp32 below 1: a uniform from fp64 rounds up to 1.0 otherwise, and 1.0 x total
# lands past the last token with weight.
_U_MAX = tl.constexpr(0.99999994)


@triton.jit
def _at(x, offs, i):
    """x[i] of a 1-D block (-inf when i is outside it)."""
    return tl.max(tl.where(offs == i, x, NEG_INF), 0)


@triton.jit
def _log_sum_exp_kernel(x_ptr, out_ptr, vocab, stride_x, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    x_row = x_ptr + j.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    # Per lane: the largest value so far and the sum of exp(x - it), rescaled as it grows.
    top = tl.full([BLOCK], NEG_INF, tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < vocab, other=NEG_INF).to(tl.float32)
        new_top = tl.maximum(top, x)
        shift = tl.where(new_top == NEG_INF, 0.0, new_top)  # a lane with no finite value yet adds 0, not NaN
        total = total * tl.exp(top - shift) + tl.exp(x - shift)
        top = new_top
    row_top = tl.max(top, 0)
    shift = tl.where(row_top == NEG_INF, 0.0, row_top)
    tl.store(out_ptr + j, row_top + tl.log(tl.sum(total * tl.exp(top - shift), 0)))


def log_sum_exp(x: torch.Tensor) -> torch.Tensor:
    """[n] fp32: log(sum(exp(x[j]))) of each row of x ([n, vocab], any float dtype)."""
    check_device(x)
    n, vocab = x.shape
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        x = _rows_contiguous(x)
        _log_sum_exp_kernel[(n,)](x, out, vocab, x.stride(0), BLOCK=_row_block(vocab), num_warps=8)
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_block(vocab: int) -> int:
    """The block a program looping over a whole row reads at once."""
    return min(WHOLE_ROW_BLOCK, next_pow2(vocab))


@triton.jit
def _penalties_kernel(
    logits_ptr, rows_ptr, ids_ptr, counts_ptr, repetition_ptr, frequency_ptr, presence_ptr, out_ptr,
    width, stride_l, stride_i, stride_c, stride_o,
    HAS_REPETITION: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr,
):
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        inside = start + offs < width
        ids = tl.load(ids_ptr + j * stride_i + start + offs, mask=inside, other=0)
        v = tl.load(logits_ptr + row * stride_l + ids, mask=inside, other=0.0).to(tl.float32)
        if HAS_REPETITION:
            r = tl.load(repetition_ptr + j)
            v = tl.where(v > 0, v / r, v * r)
        if HAS_COUNTS:
            counts = tl.load(counts_ptr + j * stride_c + start + offs, mask=inside, other=0.0)
            v = v - (tl.load(frequency_ptr + j) * counts + tl.load(presence_ptr + j) * (counts > 0).to(tl.float32))
        tl.store(out_ptr + j * stride_o + start + offs, v, mask=inside)


def penalized_values(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                     repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                     presence: torch.Tensor | None) -> torch.Tensor:
    """[p, L] fp32: logits[rows[j], ids[j, i]] penalized (services.engine.sampler.Penalties:
    rows [p], ids [p, L], output counts [p, L] fp32; repetition, frequency, presence [p] or
    [p, 1], None when no row has one; frequency and presence come together)."""
    check_device(logits)
    p, width = ids.shape
    out = torch.empty((p, width), dtype=torch.float32, device=logits.device)
    if p and width:
        dummy = counts
        _penalties_kernel[(p,)](
            logits, rows, ids, counts, dummy if repetition is None else repetition.view(-1),
            dummy if frequency is None else frequency.view(-1), dummy if presence is None else presence.view(-1), out,
            width, logits.stride(0), ids.stride(0), counts.stride(0), out.stride(0),
            HAS_REPETITION=repetition is not None, HAS_COUNTS=frequency is not None,
            BLOCK=min(1024, next_pow2(width)), num_warps=4)
    return out


@triton.jit
def _candidates_kernel(
    values_ptr, ids_ptr, index_ptr, top_k_ptr, temperature_ptr, top_p_ptr, log_min_p_ptr, uniform_ptr,
    chosen_ptr, incomplete_ptr,
    width, stride_v, stride_i, stride_u,
    ALL_CANDIDATES: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
):
    j = tl.program_id(0)
    row = tl.load(index_ptr + j)  # the row in the batch: where its parameters and token are
    offs = tl.arange(0, BLOCK)
    inside = offs < width
    raw = tl.load(values_ptr + j * stride_v + offs, mask=inside, other=NEG_INF).to(tl.float32)
    ids = tl.load(ids_ptr + j * stride_i + offs, mask=inside, other=0)
    k = tl.load(top_k_ptr + j)
    kth_raw = _at(raw, offs, k - 1)
    # Ties of the k-th may lie past the candidates when the last is not below it (a -inf k-th:
    # fewer finite values than k, all of them here).
    incomplete = (_at(raw, offs, width - 1) >= kth_raw) & (kth_raw != NEG_INF)
    t = tl.load(temperature_ptr + row)
    s = raw / t
    top = _at(s, offs, 0)  # sorted descending
    keep = (s >= kth_raw / t) & inside
    if HAS_TOP_P:
        e = tl.where(keep, tl.exp(s - top), 0.0)
        probs = e / tl.sum(e, 0)
        before = tl.cumsum(probs, 0) - probs
        last = tl.maximum(tl.sum(((before < tl.load(top_p_ptr + row)) & inside).to(tl.int32), 0), 1) - 1
        keep = keep & (s >= _at(s, offs, last))
    if HAS_MIN_P:
        keep = keep & (s >= top + tl.load(log_min_p_ptr + row))
    cdf = tl.cumsum(tl.where(keep, tl.exp(s - top), 0.0), 0)
    u = tl.minimum(tl.load(uniform_ptr + row * stride_u).to(tl.float32), _U_MAX)
    pick = tl.minimum(tl.sum(((cdf <= u * tl.max(cdf, 0)) & inside).to(tl.int32), 0), width - 1)
    tl.store(chosen_ptr + row, tl.sum(tl.where(offs == pick, ids, 0), 0))
    if ALL_CANDIDATES:
        tl.store(incomplete_ptr + j, tl.zeros((), tl.int8))
    else:
        tl.store(incomplete_ptr + j, incomplete.to(tl.int8))


def sample_candidates(values: torch.Tensor, ids: torch.Tensor, index: torch.Tensor, top_k: torch.Tensor,
                      temperature: torch.Tensor, top_p: torch.Tensor | None, log_min_p: torch.Tensor | None,
                      uniforms: torch.Tensor, chosen: torch.Tensor, all_candidates: bool) -> torch.Tensor:
    """Draw the top-k rows from their candidates, writing `chosen[index[j]]`.

    values, ids: [n, width] each row's largest values (any float dtype), sorted descending, and
    their ids; index: [n] int64, each row's row in the batch; top_k: [n] int64 (per candidate
    row); temperature, top_p, log_min_p: [batch rows] fp32 (None: the filter is off in every
    row); uniforms: [batch rows, rounds] (round 0 is used); chosen: [batch rows] int64;
    all_candidates: width is the whole vocabulary. Returns [n] bool: rows whose ties with the
    k-th value run past the candidates (their token is a placeholder)."""
    check_device(values)
    n, width = values.shape
    incomplete = torch.empty(n, dtype=torch.int8, device=values.device)
    if n:
        _candidates_kernel[(n,)](
            values, ids, index, top_k.view(-1), temperature.view(-1),
            temperature if top_p is None else top_p.view(-1), temperature if log_min_p is None else log_min_p.view(-1),
            uniforms, chosen, incomplete, width, values.stride(0), ids.stride(0), uniforms.stride(0),
            ALL_CANDIDATES=all_candidates, HAS_TOP_P=top_p is not None, HAS_MIN_P=log_min_p is not None,
            BLOCK=next_pow2(width), num_warps=4)
    return incomplete.bool()


@triton.jit
def _weights(x_row, start, offs, vocab, top, t, floor):
    """One block of a row: (w = exp((x - max) / T), 0 outside the row; w after min-p)."""
    x = tl.load(x_row + start + offs, mask=start + offs < vocab, other=NEG_INF).to(tl.float32)
    w = tl.exp((x - top) / t)
    return w, tl.where(w < floor, 0.0, w)


@triton.jit
def _whole_rows_kernel(
    x_ptr, index_ptr, temperature_ptr, top_p_ptr, log_min_p_ptr, uniform_ptr, chosen_ptr, pending_ptr,
    vocab, stride_x, stride_u,
    HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
):
    j = tl.program_id(0)
    row = tl.load(index_ptr + j)
    x_row = x_ptr + j.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    running = tl.full([BLOCK], NEG_INF, tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < vocab, other=NEG_INF).to(tl.float32)
        running = tl.maximum(running, x)
    top = tl.max(running, 0)
    t = tl.load(temperature_ptr + row)
    floor = tl.zeros((), tl.float32)
    if HAS_MIN_P:  # p / p_max = w
        floor = tl.exp(tl.load(log_min_p_ptr + row))
    # The mass of the sampled weights, summed as the draw's scan sums it (so a uniform below 1
    # always lands on a token with weight), and the mass of all of them (top-p's).
    scanned = tl.zeros((), tl.float32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        w, sample_w = _weights(x_row, start, offs, vocab, top, t, floor)
        scanned = tl.max(scanned + tl.cumsum(sample_w, 0), 0)
        mass += w
    threshold = float("inf")
    if HAS_TOP_P:
        threshold = tl.load(top_p_ptr + row) * tl.sum(mass, 0)
    pivot = tl.full((), -1.0, tl.float32)  # draw from the weights of tokens with w above it (all at first)
    token = tl.zeros((), tl.int32)
    pending = tl.full((), 1, tl.int32)
    for round_ in tl.static_range(ROUNDS):
        if pending != 0:
            u = tl.minimum(tl.load(uniform_ptr + row * stride_u + round_).to(tl.float32), _U_MAX)
            target = u * scanned
            below = tl.zeros((), tl.int32)  # tokens whose cumulative weight is at most the target: the pick
            carry = tl.zeros((), tl.float32)
            for start in range(0, vocab, BLOCK):
                w, sample_w = _weights(x_row, start, offs, vocab, top, t, floor)
                cdf = carry + tl.cumsum(tl.where(w > pivot, sample_w, 0.0), 0)
                below += tl.sum(((cdf <= target) & (start + offs < vocab)).to(tl.int32), 0)
                carry = tl.max(cdf, 0)
            pick = tl.minimum(below, vocab - 1)
            if HAS_TOP_P:
                value = tl.exp((tl.load(x_row + pick).to(tl.float32) - top) / t)
                # Inside the top-p set iff the mass strictly above the token is below top_p; else
                # everything at or below it is outside, and the next round draws above it.
                above = tl.zeros([BLOCK], tl.float32)
                scanned = tl.zeros((), tl.float32)
                for start in range(0, vocab, BLOCK):
                    w, sample_w = _weights(x_row, start, offs, vocab, top, t, floor)
                    above += tl.where(w > value, w, 0.0)
                    scanned = tl.max(scanned + tl.cumsum(tl.where(w > value, sample_w, 0.0), 0), 0)
                if tl.sum(above, 0) < threshold:
                    token = pick
                    pending = 0
                else:
                    pivot = value
            else:
                token = pick
                pending = 0
    tl.store(chosen_ptr + row, token.to(tl.int64))
    tl.store(pending_ptr + j, pending.to(tl.int8))


def sample_whole_rows(x: torch.Tensor, index: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None,
                      log_min_p: torch.Tensor | None, uniforms: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Draw rows over their whole vocabulary, writing `chosen[index[j]]`.

    x: [n, vocab] those rows' logits (any float dtype, penalties applied), row j for batch row
    index[j]; temperature, top_p, log_min_p: [batch rows] (None: off in every row); uniforms:
    [batch rows, rounds]: one top-p rejection round each (one draw without top-p). Returns [n]
    bool: the rows every round rejected (their token is a placeholder)."""
    check_device(x)
    n, vocab = x.shape
    pending = torch.empty(n, dtype=torch.int8, device=x.device)
    if n:
        x = _rows_contiguous(x)
        _whole_rows_kernel[(n,)](
            x, index, temperature.view(-1), temperature if top_p is None else top_p.view(-1),
            temperature if log_min_p is None else log_min_p.view(-1), uniforms, chosen, pending,
            vocab, x.stride(0), uniforms.stride(0),
            HAS_TOP_P=top_p is not None, HAS_MIN_P=log_min_p is not None,
            ROUNDS=uniforms.shape[1] if top_p is not None else 1,
            BLOCK=_row_block(vocab), num_warps=8)
    return pending.bool()
