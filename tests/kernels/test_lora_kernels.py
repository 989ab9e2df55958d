"""The gathered LoRA kernels (BGMV shrink and expand) against the per-token reference: a batch
mixing the base model (slot -1) and several adapters, fp32 and bf16. On CPU through the Triton
interpreter (small shapes), on CUDA compiled."""

import os

if os.environ.get("STRATA_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

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
    batch = LoRABatch(torch.device("cpu"), False, num_slots=3)
    batch.set(layout)
    assert batch.grouped is not None and len(batch.own_runs) == 2  # slot 0's two long runs as one
    out = LoRALinear(base, a, b, batch)(x)
    expect = base(x) + lora_delta_ref(x, a, b, token_slots)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)
