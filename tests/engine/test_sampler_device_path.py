"""The sampler's device path, the one GPUs run (torch ops, with the draws as Triton kernels on
CUDA), makes no host round trip inside `sample`: every
index, parameter and uniform draw is made in `prepare` (whose copies overlap the forward pass),
and the rows it cannot settle on the device come back as flags with the tokens. On a GPU a
tensor built from host data there (a blocking copy) or a value read back (`bool`, `item`,
`nonzero`) is a stream sync, so the test records the ops `sample` dispatches, on CPU tensors,
and looks for those. The Triton kernels run here through the interpreter."""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence

# Host data entering the graph, and values read back to the host (`bool` and `item` reach the
# dispatcher as is_nonzero and item under inference mode, as _local_scalar_dense outside it).
aten = torch.ops.aten
HOST_ROUND_TRIPS = {aten.lift_fresh.default, aten._local_scalar_dense.default, aten.is_nonzero.default,
                    aten.item.default, aten.nonzero.default, aten.masked_select.default}


class RoundTrips(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_ROUND_TRIPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=["torch", "triton"])
def device_path(request, monkeypatch) -> str:
    """The device path with its draws as torch ops, and as the Triton kernels CUDA runs."""
    monkeypatch.setattr(Sampler, "use_c_kernels", False)
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
        monkeypatch.setattr(Sampler, "use_triton_kernels", True)
    else:
        monkeypatch.setattr(Sampler, "use_triton_kernels", False)
    return request.param


def batch_of(params: list[SamplingParams]) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", [5, 6, 7, 8 + i], p.resolved())
        seq.token_ids.extend([9, 10 + i])
        seqs.append(seq)
    return seqs


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=7),
    SamplingParams(temperature=0.7, top_k=20, min_p=0.05, frequency_penalty=0.5),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3, logprobs=1),
    SamplingParams(temperature=1.2, top_p=0.8, presence_penalty=0.4),
    SamplingParams(temperature=0.9),
]


@pytest.mark.parametrize("params", [
    MIXED,
    [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=s) for s in range(8)],
    [SamplingParams(temperature=0.0, repetition_penalty=1.2)] * 4,
], ids=["mixed", "bench-sampled", "greedy-penalized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_makes_no_host_round_trip_on_the_device_path(monkeypatch, device_path, params, dtype):
    vocab = 5000
    sampler = Sampler(vocab)
    batch = sampler.prepare(batch_of(params))
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    with RoundTrips() as trips:
        result = sampler.sample(logits.clone(), batch)
    assert trips.seen == []
    assert len(result.token_ids) == len(params) and all(0 <= t < vocab for t in result.token_ids)
    # The same tokens as the general CPU path for the seeded and greedy rows (both use the
    # counter-based draws); unseeded rows draw from the generator in another order.
    monkeypatch.setattr(Sampler, "use_c_kernels", True)
    reference = Sampler(vocab, fused=False)
    again = reference.sample(logits.clone(), reference.prepare(batch_of(params))).token_ids
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            assert result.token_ids[i] == again[i], i


def test_unsettled_rows_still_come_out_right_on_the_device_path(device_path):
    """Ties past the candidates' room and rows rejected every round: settled after the host has
    the flags, inside the kept set."""
    vocab, n = 3000, 16
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2)) - 5
    logits[:, 100:500] = 2.0  # 400 ties at the top: past k + TOP_K_TIE_ROOM for k = 4
    params = [SamplingParams(temperature=1.0, top_k=4, seed=i) if i % 2 else
              SamplingParams(temperature=1.0, top_p=0.001, seed=i) for i in range(n)]
    sampler = Sampler(vocab)
    drawn = sampler.sample(logits.clone(), sampler.prepare(batch_of(params))).token_ids
    assert all(100 <= t < 500 for t in drawn), drawn
    assert len(set(drawn)) > n // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the CPU test above stands in")
@pytest.mark.parametrize("params", [MIXED], ids=["mixed"])
def test_on_cuda_sample_synchronizes_once(params):
    """On a GPU, CUDA's own sync detector: the step's one device-to-host copy of the tokens (and
    the flags) is the only synchronizing operation in `sample`."""
    import warnings

    vocab = 5000
    sampler = Sampler(vocab, "cuda")
    logits = torch.randn(len(params), vocab, device="cuda").bfloat16()
    batch = sampler.prepare(batch_of(params))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = sampler.sample(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    logprob_copies = 3 if any(p.logprobs is not None for p in params) else 0  # after the tokens: values, ids, top-n
    assert len(syncs) <= 1 + logprob_copies, syncs
    assert all(0 <= t < vocab for t in result.token_ids)


@pytest.mark.parametrize("params", [
    MIXED,
    [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=s) for s in range(8)],
    [SamplingParams(temperature=0.6 + 0.1 * s, top_p=0.5 + 0.05 * s, min_p=0.01 * (s % 3)) for s in range(8)],
], ids=["mixed", "bench-sampled", "top-p"])
def test_the_triton_kernels_draw_what_the_torch_ops_draw(monkeypatch, params):
    """With the same uniforms (seeded rows' counters; the others' from the same generator), every
    row draws the same token on both: fp32 logits, so that no ties reorder the candidates, and
    5,000 tokens, so that no draw lands within rounding of a boundary. On CUDA where there is one
    (compiled), else through the interpreter."""
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    monkeypatch.setattr(Sampler, "use_c_kernels", False)
    vocab = 5000
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(6)).to(device) * 2
    tokens = {}
    for triton in (False, True):
        monkeypatch.setattr(Sampler, "use_triton_kernels", triton)
        sampler = Sampler(vocab, device)
        tokens[triton] = sampler.sample(logits.clone(), sampler.prepare(batch_of(params))).token_ids
    assert tokens[True] == tokens[False]


# Kernels one sampled step launches with the draws as Triton kernels, at most (bench/sampler.py
# --launches prints them beside the torch ops': 64, 23 and 60 for these).
LAUNCH_BUDGET = {"top_p 0.9": 3, "top_k 50": 4, "bench, seeded": 9}


@pytest.mark.parametrize("setting", list(LAUNCH_BUDGET))
def test_the_triton_kernels_launch_a_few_kernels_a_step(setting):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counted on CPU tensors, through TRITON_INTERPRET=1")
    from bench.sampler import SETTINGS, count_launches, make_seqs

    vocab, rows = 5000, 8
    seqs = make_seqs(SamplingParams(**SETTINGS[setting]).resolved(), rows, vocab)
    ops, kernels = (count_launches(vocab, rows, seqs, triton) for triton in (False, True))
    assert kernels.total <= LAUNCH_BUDGET[setting] < ops.total, (dict(kernels.torch_ops), dict(kernels.triton))


def test_warm_up_compiles_every_variant_of_the_triton_kernels(monkeypatch):
    """On CUDA the engine's sampler compiles its kernels at load: each launcher runs in every
    batch-wide variant (top-p and min-p on and off; repetition and frequency/presence penalties;
    logprobs); nothing runs where the draws are torch ops."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counted on CPU tensors, through TRITON_INTERPRET=1")
    from bench.sampler import KernelLaunches

    monkeypatch.setattr(Sampler, "use_c_kernels", False)
    monkeypatch.setattr(Sampler, "use_triton_kernels", True)
    with KernelLaunches() as launches:
        Sampler(2000).warm_up(torch.bfloat16)
    assert dict(launches.triton) == {"log_sum_exp": 4, "penalized_values": 3, "sample_candidates": 4,
                                     "sample_whole_rows": 4}
    monkeypatch.setattr(Sampler, "use_triton_kernels", None)  # CPU: the C kernels, nothing to compile
    with KernelLaunches() as launches:
        Sampler(2000).warm_up(torch.bfloat16)
    assert launches.total == 0


def test_the_sampler_backend_engine_argument_picks_the_path(monkeypatch):
    """sampler_backend: torch runs torch ops even on CPU; triton the Triton kernels, refused on a
    CPU engine unless the interpreter is on; auto leaves the choice to the device."""
    from services.engine.config import EngineArgs, EngineArgsError

    if os.environ.get("TRITON_INTERPRET") == "1":
        vocab, seqs = 3000, batch_of(MIXED)
        from bench.sampler import KernelLaunches

        with KernelLaunches() as launches:
            sampler = Sampler(vocab, backend="triton")
            sampler.sample(torch.randn(len(seqs), vocab), sampler.prepare(seqs))
        assert launches.triton["sample_candidates"] == launches.triton["sample_whole_rows"] == 1
    torch_ops, auto = Sampler(100, backend="torch"), Sampler(100)
    assert (torch_ops.use_c_kernels, torch_ops.use_triton_kernels) == (False, False)
    assert (auto.use_c_kernels, auto.use_triton_kernels) == (True, None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineArgsError, match="sampler_backend: triton needs a CUDA device"):
        EngineArgs(sampler_backend="triton")
    assert EngineArgs(sampler_backend="triton", device="cuda").sampler_backend == "triton"
