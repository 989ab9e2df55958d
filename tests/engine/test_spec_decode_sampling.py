"""Verification keeps the target's distribution exactly: chi-square tests on a small vocabulary,
with the draft's distribution deliberately far from the target's, through the sampler's filters
(temperature, top-k, top-p, min-p, repetition penalty), for both rules (rejection sampling
against a draft distribution; matching point-mass drafts); and the sampler's dense filtered
distribution against the brute-force reference."""

import pytest
import torch

from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence
from services.engine.spec_decode.decoder import SpecState
from services.engine.spec_decode.rejection import rejection_sample
from services.engine.spec_decode.verifier import Verifier
from tests.engine.test_sampler import CASES, chi_square_p_value, random_logits, reference_probs, reference_set, rows

VOCAB = 12


def test_filtered_probabilities_are_the_reference_distribution():
    for ties in (False, True):
        for case in CASES:
            for seed in range(3):
                logits = random_logits(16, seed, ties)
                t = case.get("temperature", 1.0)
                params = SamplingParams(temperature=t, **{k: v for k, v in case.items() if k != "temperature"})
                sampler = Sampler(16)
                got = sampler.probs(logits.view(1, -1), sampler.prepare(rows([params])))[0].double()
                assert torch.allclose(got, reference_probs(logits, reference_set(logits, **case), t), atol=1e-5)
    greedy = Sampler(16)
    one_hot = greedy.probs(random_logits(16, 0, False).view(1, -1), greedy.prepare(rows([SamplingParams(temperature=0)])))
    assert one_hot.sum() == 1 and one_hot[0, random_logits(16, 0, False).argmax()] == 1


def test_rejection_sampling_reproduces_the_target_distribution():
    """Two positions, drafts drawn from q far from p: the first emitted token is distributed as
    p_0, the one after an accepted first draft as p_1."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, dim=-1)
    assert (p - q).abs().sum(dim=-1).min() > 0.6  # deliberately different
    n = 60000
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(2)], dim=1)
    target = torch.cat([p, p[1:]]).expand(n, 3, VOCAB)  # rows: p_0, p_1, and p_1 again for the bonus
    accepted, next_token = rejection_sample(target, q.expand(n, 2, VOCAB), drafts, torch.full((n,), 2), g)
    first = torch.where(accepted >= 1, drafts[:, 0], next_token)
    counts = torch.bincount(first, minlength=VOCAB).double()
    assert chi_square_p_value(counts, p[0].double()) > 1e-4
    past = accepted >= 1
    second = torch.where(accepted[past] >= 2, drafts[past, 1], next_token[past])
    assert chi_square_p_value(torch.bincount(second, minlength=VOCAB).double(), p[1].double()) > 1e-4
    # It accepts about sum(min(p, q)) of the first drafts, the most any exact rule can.
    assert abs(past.double().mean().item() - torch.minimum(p[0], q[0]).sum().item()) < 0.01


FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=6),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=1.0, top_k=9, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
]


def verify_many(target_logits: torch.Tensor, params: SamplingParams, n: int, draft_logits: torch.Tensor | None,
                prompt=(3, 4, 5)) -> list[int]:
    """n sequences verifying one draft each through the Verifier; the first token each emits.
    With draft_logits the draft is drawn from the draft's filtered distribution and verified by
    rejection sampling; without, it is always token 0 (a point mass, as an n-gram proposes)."""
    sampler = Sampler(VOCAB)
    sampler.generator.manual_seed(1)
    seqs = rows([params] * n, prompt=prompt)
    if draft_logits is not None:
        dsampler = Sampler(VOCAB)
        q = dsampler.probs(draft_logits.expand(n, -1), dsampler.prepare(seqs))
        drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(2)).view(-1).tolist()
    else:
        q, drafts = None, [0] * n
    flat: list[Sequence] = []
    for i, seq in enumerate(seqs):
        seq.spec_token_ids = [drafts[i]]
        seq.spec_state = SpecState(draft_probs=[q[i]] if q is not None else None)
        flat += [seq, seq]
    verifier = Verifier(sampler)
    batch = verifier.prepare(flat)
    logits = target_logits.repeat(n, 1)  # each sequence's rows: after its last token, after its draft
    emitted, result = verifier.sample(logits, batch)
    first, seen = [], set()
    for seq, token in zip(emitted, result.token_ids):
        if id(seq) not in seen:
            seen.add(id(seq))
            first.append(token)
    return first


def penalized(logits: torch.Tensor, seen: tuple, penalty: float) -> torch.Tensor:
    """Repetition penalty by its formula (transformers/CTRL) over the ids seen."""
    x = logits.clone()
    for t in set(seen):
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    return x


@pytest.mark.parametrize("rule", ["rejection", "match"])
@pytest.mark.parametrize("filters", FILTERS, ids=[str(f) for f in FILTERS])
def test_verification_keeps_the_filtered_target_distribution(rule, filters):
    g = torch.Generator().manual_seed(3)
    target = torch.randn(2, VOCAB, generator=g) * 1.5
    draft = torch.randn(1, VOCAB, generator=g) * 1.5  # unrelated to the target
    prompt = (3, 4, 5)
    n = 20000
    first = verify_many(target, SamplingParams(**filters), n, draft if rule == "rejection" else None, prompt)
    x = target[0]
    if filters.get("repetition_penalty"):
        x = penalized(x, prompt, filters["repetition_penalty"])
    t = filters["temperature"]
    kept = reference_set(x, **{k: v for k, v in filters.items() if k != "repetition_penalty"})
    expected = reference_probs(x, kept, t)
    counts = torch.bincount(torch.tensor(first), minlength=VOCAB).double()
    assert set(torch.tensor(first).unique().tolist()) <= kept
    assert chi_square_p_value(counts, expected) > 1e-4
