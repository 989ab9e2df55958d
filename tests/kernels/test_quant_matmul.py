"""The weight-only quantized matmul (kernels.quant_matmul: int8, int4, fp8 widened inside the tile
loop) against dequantize-then-matmul. On CPU under the Triton interpreter, small shapes."""

import os

if os.environ.get("STRATA_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels import quant_matmul as Q
from services.engine.quantization.weights import quantize, quantize_fp8, scheme_args

DEVICE = os.environ.get("STRATA_KERNEL_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"STRATA_KERNEL_DEVICE={DEVICE} but CUDA is not available", allow_module_level=True)


def packed(kind: str, n: int, k: int, gen) -> Q.PackedQuantWeight:
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    if kind == "fp8":
        values, scales = quantize_fp8(w)
        return Q.pack_fp8(values.to(DEVICE), scales.to(DEVICE))
    q = quantize(w, scheme_args(kind))
    return Q.pack(q.values.to(DEVICE), q.scales.to(DEVICE), q.bits, q.group_size)


def assert_matches(out, ref, dtype):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # one rounding of the fp32 result (the interpreter truncates bf16: one ulp)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=2 ** -7 if dtype == torch.bfloat16
                                   else 2 ** -10)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_quantized_matmul_equals_dequantize_then_matmul(kind, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 72, 256  # N not a multiple of the 64-wide tile; K two int4 groups
    w = packed(kind, n, k, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    fn = Q.fp8_weight_matmul if kind == "fp8" else Q.int_weight_matmul
    assert_matches(fn(x, w, bias), Q.quant_matmul_ref(x, w, bias), dtype)
    assert_matches(fn(x, w), Q.quant_matmul_ref(x, w), dtype)


def test_int4_packing_is_two_per_byte_and_fp8_reads_e4m3_exactly():
    gen = torch.Generator().manual_seed(0)
    w = packed("int4", 64, 256, gen)
    assert w.data.dtype == torch.uint8 and w.data.shape == (64, 128)
    # Every e4m3 pattern but NaN, as the kernel decodes it, against torch's own conversion.
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    values = bits.view(torch.float8_e4m3fn)
    weight = values[:240].view(16, 15)
    weight = torch.cat([weight, torch.zeros(16, 1, dtype=torch.float8_e4m3fn)], 1)  # K = 16
    fp8 = Q.pack_fp8(weight.to(DEVICE), torch.ones(16, device=DEVICE))
    eye = torch.eye(16, device=DEVICE)
    out = Q.fp8_weight_matmul(eye, fp8)  # row i of the identity picks input channel i
    torch.testing.assert_close(out.t().cpu(), weight.float(), atol=0, rtol=0)


def test_packed_sizes_and_shape_errors():
    gen = torch.Generator().manual_seed(1)
    assert packed("int8", 64, 256, gen).nbytes == 64 * 256 + 64 * 4
    assert packed("int4", 64, 256, gen).nbytes == 64 * 128 + 64 * 2 * 4
    with pytest.raises(ValueError, match="scales"):
        Q.pack(torch.zeros(8, 256, dtype=torch.int8), torch.ones(8, 3), 4, 128)
    with pytest.raises(ValueError, match="input features"):
        Q.int_weight_matmul(torch.zeros(1, 128, device=DEVICE), packed("int8", 64, 256, gen))
