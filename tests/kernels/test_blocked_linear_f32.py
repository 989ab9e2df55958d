"""The blocked kernel's fp32 path (kernels/cpu/blocked_linear.c, strata_blocked_linear_f32): fp32
activations over bf16 weights in the blocked layout, against a float64 matmul of the same values;
the AVX2 tiles (direct: 1-5 rows, one row over 1-4 blocks, two or three over 2; panel: 64 rows
and more) or the AVX-512 ones (up to 12 rows by 1-2 blocks, one row by up to 4), a pass's rows in
tiles of near-equal heights, passes over the inputs and rows, a partial last block, strided
inputs, the bias, the same bits for a row in any batch, and on an AVX-512 CPU the same bits as
the AVX2 build; and the layer that holds an fp32 weight of bf16 values."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.cpu import blocked_linear
from services.engine import linear as linear_module
from services.engine.linear import Linear, cpu_layout
from tests.kernels.test_blocked_linear import assert_same_bits_however_called

pytestmark = pytest.mark.skipif(not blocked_linear.available_f32(), reason="no AVX2 and FMA on this CPU (or no C compiler)")


def bf16_valued(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).bfloat16().float()


def assert_fp32_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """got is x w^T (+ bias) in fp32 sums: within a few fp32 steps of the sum of |terms|."""
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= 8 * torch.finfo(torch.float32).eps * scale + 1e-30).all()


# (out features, in features, rows): partial blocks (N of 1, 17, 40, 97); one row over 1-4 blocks
# (on 2 threads: N = 48, groups of 2 and 1 blocks; 222: 4, 4, 4 and 2; 250: four of 4, the last
# tile of 4 ending in the partial block); two and three rows over 2 blocks (N = 56 and 40: a tile
# of 2 ending in the partial block; 97 by 600: groups of 2, over passes); direct tiles of 2-5 rows
# and pass heights split near-evenly (rows 6-9: 3+3, 3+4, 4+4, 4+5); panel tiles from 64 rows
# (rows 64-69: 11 or 12 tiles of 5 and 6); prefill chunks of 130 and 300 rows (passes of 120, the
# blocks split in halves); K of 2 (one pair), K past a pass of 256 inputs (600: 256 + 256 + 88;
# 1024); groups claimed in turn, at least 8 a thread and at most 32 KB of sums (17000 x 1: 17
# groups of 64 blocks, the last of 39 ending in the partial block; 5600 x 3: groups of 20; 2000 x
# 9: 6 or 7; 630 x 64 and 200 x 120: 2 or 1). With AVX-512: tiles of 10-12 rows (rows 12, 23, 36:
# 12, 11+12, 12+12+12) by 2 blocks and by 1 (N = 48 and 80: 3 and 5 blocks, the last group a
# one-block tile).
SHAPES = [(1, 32, 1), (17, 6, 5), (40, 32, 3), (80, 64, 2), (97, 128, 7), (112, 96, 9), (64, 2, 4),
          (1152, 896, 1), (300, 64, 300), (1290, 1024, 3), (33, 16, 6), (48, 8, 8), (16, 8, 1),
          (48, 600, 1), (97, 600, 64), (40, 600, 65), (33, 34, 66), (17, 2, 67), (112, 600, 68),
          (64, 1024, 69), (50, 600, 130), (222, 64, 1), (250, 64, 1), (56, 64, 2), (97, 600, 3),
          (97, 600, 2), (17000, 300, 1), (5600, 300, 3), (2000, 300, 9), (630, 600, 64), (200, 600, 120),
          (48, 600, 12), (80, 64, 23), (97, 300, 36)]


@pytest.mark.parametrize("n,k,rows", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_a_float64_matmul_of_the_same_values(n, k, rows, with_bias):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = bf16_valued(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None  # any fp32 bias: the kernel holds it in fp32
    x = torch.randn(rows, k, generator=g)
    out = blocked_linear.linear(x, blocked_linear.pack(w.bfloat16(), bias))
    assert_fp32_product(out, x, w, bias)


def test_strided_and_batched_inputs_and_any_thread_count_give_the_same_bits():
    g = torch.Generator().manual_seed(1)
    w, bias = bf16_valued(136, 64, generator=g), torch.randn(136, generator=g)
    packed = blocked_linear.pack(w.bfloat16(), bias)
    x = torch.randn(11, 96, generator=g)[:, 16:80]  # rows 96 apart: read in place
    out = blocked_linear.linear(x, packed)
    assert_fp32_product(out, x, w, bias)
    assert_same_bits_however_called(x, packed, out)


def test_fp32_activations_need_a_weight_packed_without_swiglu():
    fused = blocked_linear.pack(torch.randn(64, 32).bfloat16(), swiglu=True)
    with pytest.raises(ValueError, match="without swiglu"):
        blocked_linear.linear(torch.randn(2, 32), fused)
    with pytest.raises(ValueError, match="float16"):
        blocked_linear.linear(torch.randn(2, 32).half(), blocked_linear.pack(torch.randn(16, 32).bfloat16()))


def test_bf16_exact_reads_the_low_bits():
    w = torch.randn(8, 8).bfloat16().float()
    assert blocked_linear.bf16_exact(w)
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(10.0))  # one value off the bf16 grid
    assert not blocked_linear.bf16_exact(w)
    assert not blocked_linear.bf16_exact(torch.randn(8, 8).bfloat16())  # not fp32
    assert blocked_linear.packable_as_bf16(torch.randn(8, 8).bfloat16().float())
    assert not blocked_linear.packable_as_bf16(torch.randn(8, 7).bfloat16().float())  # odd K
    assert not blocked_linear.packable_as_bf16(torch.randn(8, 8))  # off the bf16 grid


@pytest.mark.parametrize("n", [118, 1000])
def test_a_row_gets_the_same_bits_in_any_batch(n):
    """Every path sums a channel from its bias in input order (fp32 y between passes), so the
    direct tile, one row over 4 blocks (N = 118: 8 blocks, two groups of 4), two and three over 2,
    and the panel tile agree to the bit, whatever heights a batch's tiles get and however the
    blocks are grouped (N = 1000: 63 blocks in groups of 2-4 up to 64 rows, halves from 127)."""
    g = torch.Generator().manual_seed(3)
    w, bias = bf16_valued(n, 600, generator=g), torch.randn(n, generator=g)
    packed = blocked_linear.pack(w.bfloat16(), bias)
    x = torch.randn(130, 600, generator=g)
    whole = blocked_linear.linear(x, packed)
    assert_fp32_product(whole, x, w, bias)
    for rows in (1, 2, 3, 5, 16, 63, 64, 127):
        assert torch.equal(blocked_linear.linear(x[-rows:], packed), whole[-rows:])


@pytest.mark.parametrize("n,rows", [(1000, 1), (1000, 3), (1000, 16), (1000, 64), (40, 2), (17000, 1)])
def test_groups_claimed_by_any_number_of_threads_give_the_same_bits(n, rows):
    """Decode batches' groups of blocks go to whichever thread claims them first: with more
    threads than cores (claims interleave differently every call) or than groups, every output
    still comes from one tile summing in input order."""
    g = torch.Generator().manual_seed(n + rows)
    w, bias = bf16_valued(n, 600, generator=g), torch.randn(n, generator=g)
    packed = blocked_linear.pack(w.bfloat16(), bias)
    x = torch.randn(rows, 600, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3, 5, 1, 3):
            torch.set_num_threads(count)
            outs.append(blocked_linear.linear(x, packed))
    finally:
        torch.set_num_threads(threads)
    assert_fp32_product(outs[0], x, w, bias)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.skipif(not blocked_linear.f32_outruns_onednn(), reason="AVX-512 here: oneDNN takes the large calls")
def test_where_the_fp32_path_outruns_onednn_the_layer_holds_the_bf16_values_alone():
    g = torch.Generator().manual_seed(2)
    w, bias = bf16_valued(48, 32, generator=g), torch.randn(48, generator=g)
    layer = Linear(w, bias)
    assert layer.layout == "blocked" and not layer.wants_row_buckets and layer.packed is None
    assert layer.weight is None and layer.bias is None and not layer.fuses_swiglu
    assert layer.nbytes == 48 * 32 * 2 + 48 * 4  # half the fp32 weight, and the fp32 bias
    for rows in (1, 5, 64, 100):
        x = torch.randn(rows, 32, generator=g)
        out = layer(x)
        assert_fp32_product(out, x, w, bias)
        assert torch.equal(out, blocked_linear.linear(x, layer.blocked))
    assert Linear(w, swiglu=True).layout == "blocked"  # fp32 activations: never the fused SwiGLU
    assert not Linear(w, swiglu=True).fuses_swiglu
    assert cpu_layout(bf16_valued(48, 31, generator=g)) != "blocked"  # odd K
    assert cpu_layout(torch.randn(48, 32, generator=g)) != "blocked"  # values off the bf16 grid


@pytest.mark.skipif(blocked_linear.f32_outruns_onednn() or not linear_module.cpu_prepacking_available(torch.float32),
                    reason="the fp32 path takes every call here (or no oneDNN in this torch)")
def test_the_layer_runs_small_calls_on_the_bf16_copy_and_large_ones_on_onednn():
    g = torch.Generator().manual_seed(2)
    w, bias = bf16_valued(48, 32, generator=g), torch.randn(48, generator=g)
    layer = Linear(w, bias)
    assert layer.layout == "onednn+blocked" and layer.wants_row_buckets and layer.weight is None
    assert layer.nbytes == torch.ops.mkldnn._nbytes(layer.packed) + 48 * 32 * 2 + 48 * 4 + 48 * 4
    onednn = lambda x: torch.ops.mkldnn._linear_pointwise(x, layer.packed, bias, "none", [], "")  # noqa: E731
    for rows in (1, 5, linear_module.SMALL_CALL_ROWS, linear_module.SMALL_CALL_ROWS + 8):
        x = torch.randn(rows, 32, generator=g)
        out = layer(x)
        assert_fp32_product(out, x, w, bias)
        small = rows <= linear_module.SMALL_CALL_ROWS
        assert torch.equal(out, blocked_linear.linear(x, layer.blocked) if small else onednn(x))
    # fp32 values off the bf16 grid, or an odd K: oneDNN's layout alone
    assert cpu_layout(torch.randn(48, 32, generator=g)) == "onednn"
    assert cpu_layout(bf16_valued(48, 31, generator=g)) == "onednn"
    assert Linear(w, prepack=False).layout == "plain"


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory) -> ctypes.CDLL:
    """blocked_linear.c built as for a CPU without AVX-512: its AVX2 tiles, compiled once."""
    source = Path(cpu_kernels.__file__).with_name("blocked_linear.c")
    target = tmp_path_factory.mktemp("avx2") / "blocked_linear_avx2.so"
    subprocess.run([shutil.which("gcc"), *cpu_kernels.CFLAGS, "-mno-avx512f", str(source), "-o", str(target), "-lm"],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(target))
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.strata_blocked_linear_f32.restype = ctypes.c_int
    lib.strata_blocked_linear_f32.argtypes = [p, n, n, n, p, n, p, p, n, ctypes.c_int]
    return lib


@pytest.mark.skipif(not cpu_kernels.has_avx512f() or shutil.which("gcc") is None,
                    reason="no AVX-512 here: the AVX2 tiles are the ones tested above")
@pytest.mark.parametrize("n,k,rows", [(97, 600, 1), (250, 64, 1), (97, 600, 3), (40, 600, 12), (80, 64, 23),
                                      (630, 600, 64), (50, 600, 130)])
def test_the_avx512_tiles_give_the_avx2_tiles_bits(n, k, rows, avx2_build):
    """Both builds sum every output from its bias in input order, one FMA an input."""
    g = torch.Generator().manual_seed(n + k + rows)
    packed = blocked_linear.pack(bf16_valued(n, k, generator=g).bfloat16(), torch.randn(n, generator=g))
    x = torch.randn(rows, k, generator=g)
    avx2 = torch.empty(rows, n)
    rc = avx2_build.strata_blocked_linear_f32(
        x.data_ptr(), rows, k, k, packed.words.data_ptr(), n, packed.bias.data_ptr(), avx2.data_ptr(), n, 2)
    assert rc == 0
    assert torch.equal(blocked_linear.linear(x, packed), avx2)
