"""The sampler on its own, against brute-force references: the kept candidate set of top-k /
top-p / min-p (ties and edge cases included), the sampled distribution (chi-square against the
filtered softmax), penalties against their formulas, and seeded draws that depend on nothing
but (seed, position)."""

import os
import random

import pytest
import torch

from kernels import cpu as cpu_kernels
from services.engine import sampler as sampler_module
from services.engine.sampler import Sampler, counter_uniforms
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence


# Tests that draw thousands of rows: too slow for the Triton interpreter (20-60 ms a row), so they
# run on the first three paths only; tests/engine/test_sampler_triton.py checks the kernels' draws
# against references instead.
THOUSANDS_OF_DRAWS = {"test_kept_candidates_are_exactly_the_reference_set", "test_ties_at_the_top_k_boundary_stay",
                      "test_large_vocabularies_keep_the_reference_set",
                      "test_sampled_distribution_matches_the_filtered_softmax",
                      "test_a_row_masked_below_k_finite_values_draws_among_them"}


def pytest_generate_tests(metafunc):
    paths = ["fused", "general", "torch", "triton"]
    if metafunc.function.__name__ in THOUSANDS_OF_DRAWS:
        paths.remove("triton")
    metafunc.parametrize("sampler_path", paths, indirect=True)


@pytest.fixture(autouse=True)
def sampler_path(request, monkeypatch) -> str:
    """Every test on the four paths of the sampled rows: the fused C kernel (penalties,
    candidates, filters and draw in one pass), the general path (its vocabulary-wide passes in C,
    the rest in torch), the torch path other devices run (no C at all) and the Triton kernels
    CUDA runs (here through the Triton interpreter, on CPU tensors)."""
    if request.param in ("fused", "general") and cpu_kernels.load() is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    if request.param == "general":
        monkeypatch.setattr(Sampler, "_prepare_fused_table", staticmethod(lambda seqs, batch: None))
    if request.param in ("torch", "triton"):
        monkeypatch.setattr(Sampler, "use_c_kernels", False)
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on these CPU tensors need TRITON_INTERPRET=1 "
                        "(on CUDA: tests/engine/test_sampler_triton.py)")
        monkeypatch.setattr(Sampler, "use_triton_kernels", True)
    return request.param


def rows(params: list[SamplingParams], prompt=(1, 2, 3), outputs=()) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", list(prompt), p.resolved())
        seq.token_ids.extend(outputs)
        seqs.append(seq)
    return seqs


def reference_set(logits: torch.Tensor, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> set[int]:
    """The kept set, computed the slow obvious way: sort, walk, compare (threshold semantics:
    a token tied with the last kept one is kept)."""
    x = (logits.double() / temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = set(range(len(x)))
    if 0 < top_k < len(x):
        kth = x[order[top_k - 1]]
        kept = {i for i in kept if x[i] >= kth}
    if top_p < 1.0:
        z = sum(torch.tensor([x[i] for i in kept]).exp().tolist())
        mass, last = 0.0, None
        for i in order:
            if i not in kept:
                continue
            if mass >= top_p:
                break
            last = i
            mass += torch.tensor(x[i]).exp().item() / z
        kept = {i for i in kept if x[i] >= x[last]}
    if min_p > 0:
        top = max(x)
        kept = {i for i in kept if torch.tensor(x[i] - top).exp().item() >= min_p}
    return kept


def reference_probs(logits: torch.Tensor, kept: set[int], temperature=1.0) -> torch.Tensor:
    x = logits.double() / temperature
    mask = torch.tensor([i in kept for i in range(len(x))])
    return torch.softmax(x.masked_fill(~mask, float("-inf")), dim=-1)


def draw(logits: torch.Tensor, n: int, **params) -> list[int]:
    """n draws from one logits row: n rows of the batch with seeds 0..n-1."""
    sampler = Sampler(logits.shape[0])
    seqs = rows([SamplingParams(seed=seed, **params) for seed in range(n)])
    return sampler.sample(logits.expand(n, -1).clone(), sampler.prepare(seqs)).token_ids


def record_full_rows(monkeypatch) -> list[int]:
    """The rows that take the whole-row path, as `_draw_full` is called with them."""
    full_rows: list[int] = []
    draw_full = Sampler._draw_full

    def recording(self, x, batch, rows, *args, **kwargs):
        full_rows.extend(rows)
        return draw_full(self, x, batch, rows, *args, **kwargs)

    monkeypatch.setattr(Sampler, "_draw_full", recording)
    return full_rows


def random_logits(vocab: int, seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g)
    if ties:  # a run of equal values around where the cut-offs land
        order = x.argsort(descending=True)
        x[order[2:6]] = x[order[3]].item()
    return x


CASES = [
    dict(),  # no filter: every token
    dict(top_k=-1, top_p=1.0),  # the "off" values
    dict(top_k=0),  # 0 is off too
    dict(top_k=3),
    dict(top_k=4, temperature=0.5),
    dict(top_p=0.5),
    dict(top_p=0.8, temperature=1.5),
    dict(min_p=0.2),
    dict(top_k=8, top_p=0.6),
    dict(top_k=10, top_p=0.9, min_p=0.05),
    dict(top_p=0.7, min_p=0.1),
    dict(top_k=16),  # k = vocab: off
]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_kept_candidates_are_exactly_the_reference_set(case, ties):
    vocab = 16
    for seed in range(3):
        logits = random_logits(vocab, seed, ties)
        expected = reference_set(logits, **case)
        seen = set(draw(logits, 3000, temperature=case.get("temperature", 1.0),
                        **{k: v for k, v in case.items() if k != "temperature"}))
        probs = reference_probs(logits, expected, case.get("temperature", 1.0))
        assert seen <= expected, f"sampled outside the kept set: {sorted(seen - expected)}"
        likely = {i for i in expected if probs[i] > 3e-3}  # each appears in 3000 draws w.p. > 0.9999
        assert likely <= seen, f"kept tokens never sampled: {sorted(likely - seen)}"


def test_ties_at_the_top_k_boundary_stay():
    logits = torch.tensor([5.0, 4.0, 4.0, 4.0, 1.0, 0.0, -1.0, -2.0])
    assert set(draw(logits, 2000, temperature=1.0, top_k=2)) == {0, 1, 2, 3}
    # A row whose tie runs past the candidates the sampler looked at still keeps every tie.
    wide = torch.full((64,), -5.0)
    wide[0], wide[1:40] = 3.0, 2.0
    assert set(draw(wide, 4000, temperature=1.0, top_k=2)) == set(range(40))


@pytest.mark.parametrize("vocab, params", [
    (5000, dict(top_k=50, top_p=0.9)),  # the candidate path
    (5000, dict(top_p=0.5)),  # rejection sampling over whole rows
    (5000, dict(top_p=0.95, min_p=0.01, temperature=0.7)),
])
def test_large_vocabularies_keep_the_reference_set(vocab, params):
    logits = random_logits(vocab, 7, ties=False) * 3
    expected = reference_set(logits, **params)
    seen = set(draw(logits, 4000, **params))
    assert seen <= expected


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs * n >= 5  # pool rare tokens into one cell, as the test requires
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    expected = torch.cat([probs[keep] * n, (probs[~keep].sum() * n).view(1)])
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(observed) - 1
    return torch.special.gammaincc(torch.tensor(df / 2.0), stat.float() / 2).item()


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=6),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=1.0, top_k=12, top_p=0.9, min_p=0.02),
    dict(temperature=0.9, min_p=0.1),
])
def test_sampled_distribution_matches_the_filtered_softmax(params):
    logits = random_logits(24, 11, ties=False) * 1.5
    n = 30000
    tokens = draw(logits, n, **params)
    kept = reference_set(logits, **params)
    probs = reference_probs(logits, kept, params["temperature"])
    counts = torch.bincount(torch.tensor(tokens), minlength=24).double()
    assert chi_square_p_value(counts, probs) > 1e-4


def test_a_seeded_row_depends_only_on_its_seed_and_position():
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(vocab)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=42)] + [SamplingParams(temperature=0.8)] * 5
    crowd = sampler.sample(logits.clone(), sampler.prepare(rows(params)))
    alone = sampler.sample(logits[:1].clone(), sampler.prepare(rows(params[:1])))
    assert crowd.token_ids[0] == alone.token_ids[0]
    # Position is part of the key: the same seed a few tokens later draws afresh.
    later = [sampler.sample(logits[:1].clone(), sampler.prepare(rows(params[:1], outputs=[5] * k))).token_ids[0]
             for k in range(40)]
    assert len(set(later)) > 5
    u = counter_uniforms([42, 42, 43], [0, 1, 0])
    assert len(set(u.tolist())) == 3 and all(0 <= v < 1 for v in u)
    assert counter_uniforms([42], [1])[0] == u[1]  # a pure function of (seed, position)


def test_penalties_equal_their_formulas():
    vocab = 50
    rng = random.Random(3)
    prompt = [rng.randrange(vocab) for _ in range(20)]
    outputs = [rng.randrange(vocab) for _ in range(30)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(temperature=0, repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5)]
    sampler = Sampler(vocab)
    batch = sampler.prepare(rows(params, prompt=prompt, outputs=outputs))
    ours = sampler.apply_penalties(logits.clone(), batch)
    expected = logits.clone()
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt + outputs] = True
    counts = torch.bincount(torch.tensor(outputs), minlength=vocab).float()
    for i, p in enumerate(p.resolved() for p in params):
        row = expected[i]
        if p.repetition_penalty != 1.0:  # CTRL / transformers: divide positive, multiply negative
            row[seen] = torch.where(row[seen] > 0, row[seen] / p.repetition_penalty, row[seen] * p.repetition_penalty)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()  # OpenAI
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("extra", [dict(top_k=20, top_p=0.9), dict(top_p=0.8, min_p=0.01), dict(top_k=5),
                                   dict(temperature=0.0), "mixed"])
def test_penalized_rows_draw_as_if_their_logits_were_penalized_first(extra):
    """The sampler penalizes only the seen ids, aside, and masks them in the logits: every path
    (greedy, top-k candidates, whole rows) must draw what it draws from densely penalized logits."""
    vocab = 3000
    rng = random.Random(5)
    prompt = [rng.randrange(vocab) for _ in range(40)]
    outputs = [rng.randrange(200) for _ in range(60)]  # repeats: output counts above 1
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(9)) * 3
    logits[:, prompt + outputs] += 4  # the seen ids are the likely ones: penalties decide the draw
    penalties = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.3),
                 dict(repetition_penalty=0.7, presence_penalty=-0.5), dict()]
    extras = [dict(top_k=20, top_p=0.9), dict(top_p=0.8), dict(temperature=0.0)] if extra == "mixed" else [extra]
    params, plain = [], []
    for i in range(12):
        base = {"temperature": 0.9, "seed": 100 + i, **extras[i % len(extras)]}
        params.append(SamplingParams(**base, **penalties[i % len(penalties)]))
        plain.append(SamplingParams(**base))
    sampler = Sampler(vocab)
    batch = sampler.prepare(rows(params, prompt=prompt, outputs=outputs))
    penalized_first = sampler.apply_penalties(logits.clone(), batch)
    want = sampler.sample(penalized_first, sampler.prepare(rows(plain, prompt=prompt, outputs=outputs))).token_ids
    assert sampler.sample(logits.clone(), batch).token_ids == want
    assert len(set(want)) > 3


def test_penalized_ties_wider_than_the_merged_candidates_take_the_full_row(monkeypatch, sampler_path):
    """More values tied with the k-th after the penalties than the general path's merged
    candidates hold: its rows must go the full-row way and draw only from the densely penalized
    rows' kept set (the k-th value and its ties), seen and unseen ids alike. The fused kernel
    merges every seen value at or above the unseen k-th, so it keeps them all itself; the Triton
    path takes its candidates from the densely penalized rows (k + TOP_K_TIE_ROOM of them)."""
    vocab, k, n = 3000, 5, 64
    seen_ids = list(range(100, 100 + sampler_module.MERGED_TIE_ROOM + 40))
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3))
    logits[:, seen_ids] = 8.0  # halved by the penalty: tied with the unseen 4.0s below
    logits[:, 10:10 + k] = 4.0
    params = [SamplingParams(temperature=1.0, top_k=k, seed=i, repetition_penalty=2.0) for i in range(n)]
    sampler = Sampler(vocab)
    batch = sampler.prepare(rows(params, prompt=seen_ids))
    kept = reference_set(sampler.apply_penalties(logits.clone(), batch)[0], top_k=k)
    assert kept == set(seen_ids) | set(range(10, 10 + k))
    full_rows = record_full_rows(monkeypatch)
    drawn = sampler.sample(logits.clone(), batch).token_ids
    assert sorted(full_rows) == (list(range(n)) if sampler_path in ("general", "torch") else [])
    assert set(drawn) <= kept and set(drawn) & set(seen_ids) and len(set(drawn)) > n // 2


def test_ties_past_the_tie_room_take_the_full_row(monkeypatch, sampler_path):
    """More values tied with the k-th than k + TOP_K_TIE_ROOM candidates: on either path the
    rows go the full-row way and every tie stays drawable."""
    vocab, k, n, ties = 3000, 4, 48, sampler_module.TOP_K_TIE_ROOM + 100
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)) - 5
    logits[:, 1000:1000 + ties] = 2.0
    full_rows = record_full_rows(monkeypatch)
    sampler = Sampler(vocab)
    params = [SamplingParams(temperature=1.0, top_k=k, seed=i, repetition_penalty=1.2 if i % 2 else 1.0)
              for i in range(n)]
    drawn = sampler.sample(logits.clone(), sampler.prepare(rows(params))).token_ids
    assert sorted(full_rows) == list(range(n))
    assert set(drawn) <= set(range(1000, 1000 + ties)) and len(set(drawn)) > n // 2


def test_the_c_counter_uniform_is_the_samplers():
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    seeds, positions = [0, 42, 2 ** 63 + 5, -7], [0, 1, 12345, 2 ** 31]
    for round_ in (0, 3):
        assert [cpu_kernels.counter_uniform(s, p, round_) for s, p in zip(seeds, positions)] == \
            counter_uniforms(seeds, positions, round_).tolist()


def test_logprobs_only_for_rows_that_ask_and_from_the_raw_logits():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    sampler = Sampler(vocab)
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, seed=1, logprobs=0)]
    out = sampler.sample(logits.clone(), sampler.prepare(rows(params)))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    chosen, top = out.logprobs[0]
    assert chosen == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    assert list(top) == raw[0].topk(3).indices.tolist()
    chosen, top = out.logprobs[2]
    assert top == {} and chosen == pytest.approx(raw[2, out.token_ids[2]].item(), abs=1e-6)


def test_greedy_rows_in_a_sampled_batch_take_the_argmax():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(1000)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=20 if i % 4 == 0 else -1) for i in range(8)]
    out = sampler.sample(logits.clone(), sampler.prepare(rows(params)))
    for i in range(1, 8, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_whole_rows_rejected_every_c_round_finish_on_the_general_path(monkeypatch, sampler_path):
    """A tiny top-p over a flat row: the pivot needs more rounds than the C kernel makes
    (CPU_SAMPLE_ROUNDS), so some rows are handed back; they still draw inside the top-p set."""
    vocab = 3000
    logits = random_logits(vocab, 8, ties=False) * 0.5
    expected = reference_set(logits, top_p=0.005)
    full_rows = record_full_rows(monkeypatch)
    drawn = draw(logits, 48, temperature=1.0, top_p=0.005)
    assert set(drawn) <= expected and len(set(drawn)) > 1
    assert 0 < len(full_rows) < 48 if sampler_path == "fused" else len(full_rows) == 48


def test_a_row_masked_below_k_finite_values_draws_among_them(monkeypatch):
    """A grammar or allowed_token_ids can leave fewer finite logits than top_k: the row draws
    among those, on the candidate path (no whole-row fallback)."""
    vocab = 5000
    logits = torch.full((vocab,), float("-inf"))
    logits[[7, 300, 4100]] = torch.tensor([1.0, 0.5, 0.2])
    full_rows = record_full_rows(monkeypatch)
    drawn = draw(logits, 600, temperature=1.0, top_k=50, top_p=0.99, repetition_penalty=1.2)
    assert set(drawn) == {7, 300, 4100} and not full_rows
