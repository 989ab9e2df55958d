"""The gathered LoRA kernels (BGMV shrink and expand) against the per-token reference: a batch
mixing the base model (slot -1) and several adapters, fp32 and bf16. On CPU through the Triton
interpreter (small shapes), on CUDA compiled."""

import os

if os.environ.get("STRATA_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.lora import bgmv_expand, bgmv_shrink, lora_delta_ref

DEVICE = os.environ.get("STRATA_KERNEL_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"STRATA_KERNEL_DEVICE={DEVICE} but CUDA is not available", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fan_in,rows,fan_out", [(96, 24, 80), (200, 48, 130)])  # rows: n_slices * R
def test_bgmv_matches_reference(dtype, fan_in, rows, fan_out):
    g = torch.Generator().manual_seed(fan_in)
    slots_n, tokens = 3, 7
    x = torch.randn(tokens, fan_in, generator=g).to(DEVICE, dtype)
    a = (torch.randn(slots_n, rows, fan_in, generator=g) / fan_in ** 0.5).to(DEVICE, dtype)
    b = (torch.randn(slots_n, rows, fan_out, generator=g) / rows ** 0.5).to(DEVICE, dtype)
    token_slots = torch.tensor([0, -1, 2, 2, 1, -1, 0], dtype=torch.int32, device=DEVICE)
    base = torch.randn(tokens, fan_out, generator=g).to(DEVICE, dtype)
    y = bgmv_shrink(x, a, token_slots)
    assert y.dtype == torch.float32 and y.shape == (tokens, rows)
    assert (y[token_slots == -1] == 0).all()
    out = bgmv_expand(y, b, token_slots, base.clone())
    expect = base.float() + lora_delta_ref(x, a, b, token_slots)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), expect, **tol)
    assert torch.equal(out[token_slots == -1], base[token_slots == -1])  # the base model's rows untouched


@pytest.mark.skipif(DEVICE != "cpu", reason="the torch path runs on CPU tensors")
def test_lora_linear_triton_path_equals_torch_path():
    """LoRALinear with the Triton kernels gives what its torch runs give, on the same batch."""
    from services.engine.linear import Linear
    from services.engine.lora.layers import LoRABatch, LoRALinear

    g = torch.Generator().manual_seed(1)
    base = Linear(torch.randn(40, 32, generator=g), prepack=False)
    a, b = torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 40, generator=g)
    x = torch.randn(9, 32, generator=g)
    layout = [(1, 3), (-1, 2), (0, 4)]
    results = []
    for use_triton in (False, True):
        batch = LoRABatch(torch.device("cpu"), use_triton)
        batch.set(layout)
        results.append(LoRALinear(base, a, b, batch)(x))
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(DEVICE != "cpu", reason="the torch path runs on CPU tensors")
def test_lora_linear_torch_paths_match_reference():
    """Every CPU path against the per-token reference: long runs of one adapter apart in the
    batch (gathered into one matmul pair), a long run alone, and decodes grouped per slot."""
    from services.engine.linear import Linear
    from services.engine.lora.layers import LONG_RUN, LoRABatch, LoRALinear

    g = torch.Generator().manual_seed(2)
    base = Linear(torch.randn(40, 32, generator=g), prepack=False)
    a, b = torch.randn(3, 16, 32, generator=g), torch.randn(3, 16, 40, generator=g)
    long = LONG_RUN + 1
    layout = [(0, long), (-1, 2), (2, long), (0, long), (1, 1), (2, 1), (0, 1), (1, 1), (-1, 1)]
    x = torch.randn(sum(n for _, n in layout), 32, generator=g)
    token_slots = torch.tensor([slot for slot, n in layout for _ in range(n)], dtype=torch.int32)
    expect = base(x) + lora_delta_ref(x, a, b, token_slots)
    batch = LoRABatch(torch.device("cpu"), False, num_slots=3)
    batch.use_cpu_kernel = False  # the grouped torch path, as without a C compiler
    batch.set(layout)
    assert batch.grouped is not None and len(batch.own_runs) == 2  # slot 0's two long runs as one
    torch.testing.assert_close(LoRALinear(base, a, b, batch)(x), expect, atol=1e-4, rtol=1e-4)
    if cpu_kernels.load() is not None:  # the short runs through kernels/cpu/lora.c instead
        batch = LoRABatch(torch.device("cpu"), False, num_slots=3)
        batch.set(layout)
        assert batch.kernel_groups is not None and batch.grouped is None and len(batch.own_runs) == 2
        torch.testing.assert_close(LoRALinear(base, a, b, batch)(x), expect, atol=1e-4, rtol=1e-4)


def block_diagonal_b(g: torch.Generator, slots: int, rank: int, widths: list[int]) -> torch.Tensor:
    """B as the engine holds it: slice i's rows only in slice i's columns (zero elsewhere)."""
    b = torch.zeros(slots, len(widths) * rank, sum(widths))
    col = 0
    for i, w in enumerate(widths):
        b[:, i * rank:(i + 1) * rank, col:col + w] = torch.randn(slots, rank, w, generator=g) / rank ** 0.5
        col += w
    return b


@pytest.mark.skipif(DEVICE != "cpu", reason="the C kernels run on CPU tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fan_in,rank,widths", [(96, 8, [40, 24, 24]), (200, 16, [130]), (70, 20, [70, 70])])
def test_cpu_sgmv_kernel_matches_reference(dtype, fan_in, rank, widths):
    """kernels/cpu/lora.c against the per-token reference: tokens of a slot apart and out of
    order, groups of 1 to 9 tokens (the 4-token passes and their tails), base-model tokens left
    untouched, slice widths that are not multiples of the 64-column blocks, ranks that are not
    multiples of the 16-row shrink."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(fan_in + rank)
    slots_n, tokens = 4, 17
    x = torch.randn(tokens, fan_in, generator=g).to(dtype)
    a = (torch.randn(slots_n, len(widths) * rank, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
    b = block_diagonal_b(g, slots_n, rank, widths).to(dtype)
    members = {2: [3, 0, 9, 16, 5, 11, 1, 7, 13], 0: [2], 3: [4, 15, 8, 6, 12]}  # 10 and 14: base model
    token_slots = torch.full((tokens,), -1, dtype=torch.int32)
    for slot, ts in members.items():
        token_slots[ts] = slot
    starts = [0]
    for ts in members.values():
        starts.append(starts[-1] + len(ts))
    groups = (torch.tensor([t for ts in members.values() for t in ts]), torch.tensor(starts), torch.tensor(list(members)))
    base = torch.randn(tokens, sum(widths), generator=g).to(dtype)
    out = cpu_kernels.lora_sgmv(x, a, b, torch.tensor([0, *widths]).cumsum(0), groups, base.clone())
    expect = base.float() + lora_delta_ref(x, a, b, token_slots)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), expect, **tol)
    assert torch.equal(out[token_slots == -1], base[token_slots == -1])
