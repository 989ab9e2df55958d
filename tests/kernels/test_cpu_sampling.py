"""The sampler's C kernels on their own (kernels/cpu/sampling.c): logprob rows against torch's
log-softmax, and the fused sampler's contract (it checks what it is given before writing, and
leaves the logits as it found them)."""

import numpy as np
import pytest
import torch

from kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the CPU kernels are not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_rows_equal_torch_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 5003, generator=g) * 4).to(dtype)
    padded = torch.cat([logits, torch.zeros(6, 13, dtype=dtype)], dim=1)[:, :5003]  # a row stride past the vocab
    targets = torch.randint(0, 5003, (6,), generator=g)
    lse, values, ids, own, rank = cpu_kernels.logprob_rows(padded, 7, targets)
    ref = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), dim=-1), atol=2e-5, rtol=0)
    torch.testing.assert_close(values, ref.topk(7).values, atol=2e-5, rtol=0)
    torch.testing.assert_close(ref.gather(1, ids), values, atol=2e-5, rtol=0)  # the ids name those values
    torch.testing.assert_close(own, ref.gather(1, targets.view(-1, 1)).view(-1), atol=2e-5, rtol=0)
    assert rank.tolist() == ((logits.float() > logits.float().gather(1, targets.view(-1, 1))).sum(1) + 1).tolist()
    lse0, values0, _, none, _ = cpu_kernels.logprob_rows(logits, 0)
    assert values0.shape == (6, 0) and none is None and torch.equal(lse0, cpu_kernels.logprob_rows(logits, 3)[0])


def fused_rows(n: int, **fields) -> np.ndarray:
    table = np.zeros(n, dtype=cpu_kernels.SAMPLE_ROW)
    table["row"] = np.arange(n)
    table["temperature"], table["top_p"], table["log_min_p"], table["repetition"] = 1.0, 1.0, -np.inf, 1.0
    for name, value in fields.items():
        table[name] = value
    return table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_sampler_restores_the_seen_ids_it_masks(dtype):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = logits.clone()
    seen = np.array([5, 17, 400, 999] * 4, dtype=np.int64)
    table = fused_rows(4, top_k=[20, 0, 20, 0], seen_len=4, seen_offset=[0, 4, 8, 12], repetition=1.5,
                       top_p=0.9, seed=[1, 2, 3, 4])
    out = np.empty(4, dtype=np.int64)
    left = cpu_kernels.sample_fused(logits, table, seen, np.ones(16, dtype=np.float32), 256, 8, out)
    assert left == 0 and ((out >= 0) & (out < 1000)).all()
    assert torch.equal(logits, before)


@pytest.mark.parametrize("bad", [dict(row=[1, 0]), dict(row=[0, 4]), dict(top_k=[1000, 0]), dict(top_k=[-1, 0]),
                                 dict(temperature=0.0), dict(seen_len=3, seen_offset=[0, 2]),
                                 dict(seen_len=1, seen_offset=[0, 3], bad_id=True)])
def test_the_fused_sampler_refuses_what_does_not_fit_before_writing(bad):
    logits = torch.randn(4, 1000)
    before = logits.clone()
    seen = np.array([1, 2, 3, 4000 if bad.pop("bad_id", False) else 4], dtype=np.int64)
    out = np.full(4, 7, dtype=np.int64)
    with pytest.raises(ValueError):
        cpu_kernels.sample_fused(logits, fused_rows(2, **bad), seen, np.ones(4, dtype=np.float32), 256, 8, out)
    assert torch.equal(logits, before) and (out == 7).all()
