"""The sampler's Triton kernels (kernels/sampling.py) against float64 references: with the same
uniforms, each row must draw the token the reference draws, the kept set coming from
test_sampler's brute-force `reference_set`. Rows whose draw lands within rounding of a boundary
(a cumulative weight, the top-p threshold) are left out: fp32 sums may fall either side.

Compiled on CUDA; here through the Triton interpreter (20-60 ms a row), so a few dozen rows a
case. test_sampler.py runs the sampler's own tests on this path too, those with few rows."""

import math
import os

import numpy as np
import pytest
import torch

from services.engine.sampler import TOP_K_TIE_ROOM
from tests.engine.test_sampler import random_logits, reference_set

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
NEAR = 1e-5  # relative distance to a boundary under which a row is left out
ROUNDS = 3


def sampling_kernels():
    from kernels import sampling
    return sampling


def columns(n: int, temperature=1.0, top_p=1.0, min_p=0.0):
    column = lambda v: torch.full((n, 1), v, dtype=torch.float32, device=DEVICE)  # noqa: E731
    return (column(temperature), column(top_p) if top_p < 1.0 else None,
            column(math.log(min_p)) if min_p > 0 else None)


def inverse_cdf(weights: np.ndarray, u: float) -> tuple[int, float]:
    """(the index drawn, how near the target is to a boundary, relative to the total)."""
    cdf = np.cumsum(weights)
    target = u * cdf[-1]
    return int(np.searchsorted(cdf, target, side="right")), float(np.min(np.abs(cdf - target)) / cdf[-1])


CANDIDATE_CASES = [dict(top_k=3), dict(top_k=4, temperature=0.5), dict(top_k=8, top_p=0.6),
                   dict(top_k=10, top_p=0.9, min_p=0.3), dict(top_k=50, top_p=0.95, temperature=0.8),
                   dict(top_k=20, min_p=0.2, temperature=0.7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=[str(c) for c in CANDIDATE_CASES])
def test_candidate_draws_are_the_references(case, ties, dtype):
    n, vocab, k = 16, 1000, case["top_k"]
    logits = torch.stack([random_logits(vocab, seed, ties) * 2 for seed in range(n)]).to(dtype)
    logits[n - 1, 200:200 + k + TOP_K_TIE_ROOM] = 50.0  # ties past the candidates: flagged, not drawn
    uniforms = torch.rand(n, ROUNDS, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    temperature, top_p, log_min_p = columns(n, case.get("temperature", 1.0), case.get("top_p", 1.0),
                                            case.get("min_p", 0.0))
    values, ids = logits.topk(k + TOP_K_TIE_ROOM, dim=-1)
    chosen = torch.full((n,), -1, dtype=torch.int64, device=DEVICE)
    incomplete = sampling_kernels().sample_candidates(
        values.to(DEVICE), ids.to(DEVICE), torch.arange(n, device=DEVICE), torch.full((n,), k, device=DEVICE),
        temperature, top_p, log_min_p, uniforms.to(DEVICE), chosen, all_candidates=False)
    assert incomplete.tolist() == [False] * (n - 1) + [True]
    checked = 0
    for j in range(n - 1):
        kept = reference_set(logits[j].float(), **case)
        x = (logits[j].double() / case.get("temperature", 1.0)).numpy()
        order = ids[j].tolist()  # the draw walks the candidates in descending order
        weights = np.array([math.exp(x[i] - x.max()) if i in kept else 0.0 for i in order])
        assert set(order) >= kept
        pick, near = inverse_cdf(weights, float(uniforms[j, 0]))
        if near > NEAR:
            assert int(chosen[j]) == order[pick], (j, int(chosen[j]), order[pick])
            checked += 1
    assert checked >= n - 3


def reference_whole_row(x: np.ndarray, us: list[float], top_p: float, min_p: float) -> tuple[int | None, float]:
    """The whole-row draw in float64, the kernel's algorithm: rejection against a rising pivot.
    (token, or None when every round rejected; the nearest boundary any decision met)."""
    w = np.exp(x - x.max())
    sample_w = np.where(w < min_p, 0.0, w)
    threshold, pivot, nearest = top_p * w.sum(), -1.0, 1.0
    for u in us:
        pick, near = inverse_cdf(np.where(w > pivot, sample_w, 0.0), u)
        nearest = min(nearest, near)
        if top_p >= 1.0:
            return pick, nearest
        above = w[w > w[pick]].sum()
        nearest = min(nearest, abs(above - threshold) / w.sum())
        if above < threshold:
            return pick, nearest
        pivot = w[pick]
    return None, nearest


WHOLE_CASES = [dict(), dict(temperature=0.7), dict(top_p=0.5), dict(top_p=0.8, temperature=1.5), dict(min_p=0.2),
               dict(top_p=0.7, min_p=0.1), dict(top_p=0.01)]  # top_p 0.01: most rows pending after 3 rounds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", WHOLE_CASES, ids=[str(c) for c in WHOLE_CASES])
def test_whole_row_draws_are_the_references(case, dtype):
    n, vocab = 12, 2500  # two of the kernel's blocks, the second partial
    logits = torch.stack([random_logits(vocab, seed, ties=seed % 3 == 0) * 1.5 for seed in range(n)]).to(dtype)
    uniforms = torch.rand(n, ROUNDS, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    t, p, min_p = case.get("temperature", 1.0), case.get("top_p", 1.0), case.get("min_p", 0.0)
    temperature, top_p, log_min_p = columns(n, t, p, min_p)
    # Rows 0..n-1 of x are batch rows n-1..0: the parameters and tokens go by the index.
    index = torch.arange(n - 1, -1, -1, device=DEVICE)
    chosen = torch.full((n,), -1, dtype=torch.int64, device=DEVICE)
    pending = sampling_kernels().sample_whole_rows(logits.flip(0).to(DEVICE), index, temperature, top_p, log_min_p,
                                                   uniforms.to(DEVICE), chosen)
    checked = 0
    for row in range(n):
        want, near = reference_whole_row((logits[row].double() / t).numpy(), uniforms[row].tolist(), p, min_p)
        if near <= NEAR:
            continue
        checked += 1
        assert bool(pending[n - 1 - row]) == (want is None), row
        if want is not None:
            assert int(chosen[row]) == want, (row, int(chosen[row]), want)
            assert want in reference_set(logits[row].float(), **case)
    assert checked >= n - 2
    if p == 0.01:
        assert pending.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_penalized_values_are_the_formulas(dtype):
    """The kernel's seen values equal the torch path's (repetition as transformers, frequency and
    presence as OpenAI), padding included."""
    import random

    from services.engine.sampler import Sampler
    from services.engine.sampling_params import SamplingParams
    from tests.engine.test_sampler import rows

    vocab, rng = 3000, random.Random(4)
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, frequency_penalty=0.4, presence_penalty=0.6),
              SamplingParams(temperature=0.8, repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=1.5)]
    seqs = rows(params, prompt=[rng.randrange(vocab) for _ in range(1500)])  # seen ids past one block
    for i, seq in enumerate(seqs):
        seq.token_ids.extend(rng.randrange(vocab // (i + 1)) for _ in range(300))  # repeats: counts above 1
    sampler = Sampler(vocab, DEVICE)
    pen = sampler.prepare(seqs).penalties
    logits = (torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(3)) * 3).to(dtype).to(DEVICE)
    got = sampling_kernels().penalized_values(logits, pen.rows, pen.ids, pen.output_counts, pen.repetition,
                                              pen.frequency, pen.presence)
    torch.testing.assert_close(got, Sampler.penalized_values(logits, pen), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0) for the -inf row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_log_sum_exp_is_torchs(dtype):
    """Rows of two and a half blocks: some masked to a few finite values, one with a large spread."""
    x = torch.randn(5, 5000, generator=torch.Generator().manual_seed(8)) * 4
    x[1, 100:] = float("-inf")
    x[2, :2500] = float("-inf")  # no finite value in the first block's lanes
    x[3] *= 20
    x[4] = float("-inf")  # nothing allowed: -inf, as torch
    x = x.to(dtype)
    got = sampling_kernels().log_sum_exp(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got, torch.logsumexp(x.float(), dim=-1), rtol=1e-5, atol=1e-5)
