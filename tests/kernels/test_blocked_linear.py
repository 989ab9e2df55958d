"""The bf16 blocked linear kernel (kernels/cpu/blocked_linear.c) against an fp32 matmul: every
tile shape (1-4 rows by 1-4 blocks, a partial last block), row chunks, strided inputs, the bias;
SwiGLU fused into a gate/up product against the element-wise kernel; and the layer that holds a
weight in its layout. Every test runs on AVX512-BF16's vector tiles and, where the CPU has them,
again on AMX's tiles (K a multiple of 32: one or two row tiles of up to 16 rows, one or two
blocks a step; other K take the vector tiles)."""

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.cpu import blocked_linear
from services.engine.linear import Linear, cpu_layout

pytestmark = pytest.mark.skipif(not blocked_linear.available(),
                                reason="no AVX512-BF16 on this CPU (or no C compiler): oneDNN runs bf16 weights")


@pytest.fixture(autouse=True, params=["vector", "amx"])
def tiles(request):
    """Which tiles run the bf16 calls: AVX512-BF16's vectors, or AMX's where there are."""
    if not cpu_kernels.use_amx(request.param == "amx") and request.param == "amx":
        pytest.skip("no AMX on this CPU (or the OS refused this process its tiles)")
    yield request.param
    cpu_kernels.use_amx(True)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().t()
    return out + bias.float() if bias is not None else out


def assert_rounded_from(got: torch.Tensor, exact: torch.Tensor, slack: torch.Tensor | float = 0.0) -> None:
    """got is exact rounded to bf16, give or take one bf16 step (fp32 sums in another order) and
    `slack` (what fp32 sums may lose where they cancel)."""
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    step = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-30)
    assert ((got.float() - exact).abs() <= step + slack).all()


def fp32_sum_slack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The most K fp32 additions of these products can lose: K ulps of the sum of their sizes."""
    return x.shape[-1] * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())


def case(n: int, k: int, rows: int, with_bias: bool):
    """A bf16 weight [n, k], its bias or None, and x [rows, k], seeded by the shape."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    return w, bias, torch.randn(rows, k, generator=g).bfloat16()


# (out features, in features, rows): partial blocks (N of 1, 17, 40), 1-3 trailing blocks of a
# group of 4 (N = 64 + 16, + 33, + 48), rows 1-9 (every tile height and a remainder), 300 rows (two
# chunks of 256, the second not a multiple of 4), K of 2 (one pair), a weight past 2 MB (in
# huge pages, with a tail in small ones).
SHAPES = [(1, 32, 1), (17, 6, 5), (40, 32, 3), (80, 64, 2), (97, 128, 7), (112, 96, 9), (64, 2, 4),
          (1152, 896, 1), (300, 64, 300), (1290, 1024, 3)]


@pytest.mark.parametrize("n,k,rows", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_an_fp32_matmul_rounded_once(n, k, rows, with_bias):
    w, bias, x = case(n, k, rows, with_bias)
    assert_rounded_from(blocked_linear.linear(x, blocked_linear.pack(w, bias)), reference(x, w, bias))


def test_strided_and_batched_inputs_and_any_thread_count_give_the_same_bits():
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(136, 64, generator=g).bfloat16(), torch.randn(136, generator=g).bfloat16()
    packed = blocked_linear.pack(w, bias)
    wide = torch.randn(11, 96, generator=g).bfloat16()
    x = wide[:, 16:80]  # rows 96 apart: read in place
    out = blocked_linear.linear(x, packed)
    assert_rounded_from(out, reference(x, w, bias))
    assert_same_bits_however_called(x, packed, out)


def assert_same_bits_however_called(x: torch.Tensor, packed, out: torch.Tensor) -> None:
    """x [rows, K], strided: contiguous, batched, on one thread, the kernel gives `out`'s bits."""
    rows, width = out.shape
    assert torch.equal(blocked_linear.linear(x.contiguous(), packed), out)
    assert torch.equal(blocked_linear.linear(x.contiguous().view(1, rows, -1), packed), out.view(1, rows, width))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(blocked_linear.linear(x, packed), out)  # one tile computes each output
    finally:
        torch.set_num_threads(threads)
    assert blocked_linear.linear(x[:0], packed).shape == (0, width)


def test_what_the_kernel_does_not_take_is_refused():
    for weight in (torch.randn(16, 7).bfloat16(), torch.randn(16, 8), torch.randn(16, 0).bfloat16()):
        assert not blocked_linear.packable(weight)
        with pytest.raises(ValueError, match="blocked weight"):
            blocked_linear.pack(weight)
    packed = blocked_linear.pack(torch.randn(16, 8).bfloat16())
    with pytest.raises(ValueError, match="bf16 CPU activations"):
        blocked_linear.linear(torch.randn(2, 8).half(), packed)
    with pytest.raises(ValueError, match="8 inputs got 6"):
        blocked_linear.linear(torch.randn(2, 6).bfloat16(), packed)


# (out features, in features, rows) for AMX's tiles: K of one and of several tiles of 16 pairs,
# one and two row tiles with every remainder kind (1, 15, 16, 17, 31, 32, 33 rows), an odd last
# block and a partial one, and rows past a chunk of 256.
AMX_SHAPES = [(16, 32, 1), (48, 64, 15), (40, 96, 16), (80, 32, 17), (97, 128, 31), (112, 64, 32),
              (1152, 896, 33), (200, 896, 64), (136, 64, 300)]


@pytest.mark.parametrize("n,k,rows", AMX_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_tile_shapes_equal_an_fp32_matmul_rounded_once(n, k, rows, with_bias):
    w, bias, x = case(n, k, rows, with_bias)
    packed = blocked_linear.pack(w, bias)
    out = blocked_linear.linear(x, packed)
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    assert_rounded_from(out, exact.float(), fp32_sum_slack(x, w).float())
    # a row's sums run in the same order in any batch: its bits do not depend on the others
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(blocked_linear.linear(x[r:r + 1], packed), out[r:r + 1])
    strided = torch.cat([x, x], dim=1)[:, :k]
    assert torch.equal(blocked_linear.linear(strided, packed), out)


def test_k_off_amx_tiles_takes_the_vector_tiles_bits(tiles):
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 48, generator=g).bfloat16(), torch.randn(20, 48, generator=g).bfloat16()
    packed = blocked_linear.pack(w)  # K = 48: 24 pairs, not whole tiles of 16
    out = blocked_linear.linear(x, packed)
    cpu_kernels.use_amx(False)
    assert torch.equal(out, blocked_linear.linear(x, packed))


# (half width h, in features, rows): one pair of blocks, a group and a half (the last group one
# pair), tile heights 1-4 with remainders, two row chunks.
SWIGLU_SHAPES = [(16, 32, 1), (48, 64, 5), (96, 40, 7), (64, 128, 300), (48, 64, 33)]


@pytest.mark.parametrize("half,k,rows", SWIGLU_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_fused_into_the_product_gives_the_element_wise_bits(half, k, rows, with_bias):
    g = torch.Generator().manual_seed(half * 100 + rows)
    w = torch.randn(2 * half, k, generator=g).bfloat16()  # [gate; up]
    bias = torch.randn(2 * half, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    plain, fused = blocked_linear.pack(w, bias), blocked_linear.pack(w, bias, swiglu=True)
    product = blocked_linear.linear(x, plain)
    # the interleaved layout still computes [gate | up] in order (what a LoRA wrapper reads)
    assert torch.equal(blocked_linear.linear(x, fused), product)
    out = blocked_linear.swiglu(x, fused)
    assert out.shape == (rows, half)
    assert torch.equal(out, cpu_kernels.silu_and_mul(product))
    gate, up = product.float().chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate.bfloat16()) * up.bfloat16(), rtol=0.016, atol=0.01)


def test_swiglu_needs_whole_blocks_of_gate_and_up():
    w = torch.randn(48, 32).bfloat16()  # halves of 24 channels
    assert blocked_linear.packable(w) and not blocked_linear.packable(w, swiglu=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        blocked_linear.pack(w, swiglu=True)
    with pytest.raises(ValueError, match="swiglu=True"):
        blocked_linear.swiglu(torch.randn(2, 32).bfloat16(), blocked_linear.pack(w))
    layer = Linear(w, swiglu=True)  # still blocked, the activation left to the element-wise op
    assert layer.layout == "blocked" and not layer.fuses_swiglu
    with pytest.raises(ValueError, match="does not fuse SwiGLU"):
        layer.swiglu(torch.randn(2, 32).bfloat16())
    fused = Linear(torch.randn(64, 32).bfloat16(), swiglu=True)
    x = torch.randn(3, 32).bfloat16()
    assert fused.fuses_swiglu and torch.equal(fused.swiglu(x), cpu_kernels.silu_and_mul(fused(x)))
    assert not Linear(torch.randn(64, 32), swiglu=True).fuses_swiglu  # fp32: oneDNN's layout


def test_the_layer_holds_bf16_weights_blocked_and_others_as_before():
    g = torch.Generator().manual_seed(2)
    w, bias = torch.randn(48, 32, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    layer = Linear(w, bias)
    assert layer.layout == "blocked" and layer.weight is None and not layer.wants_row_buckets
    assert layer.nbytes == 48 * 32 * 2 + 48 * 4  # the weight, and the bias held in fp32
    x = torch.randn(5, 32, generator=g).bfloat16()
    assert_rounded_from(layer(x), reference(x, w, bias))
    assert cpu_layout(torch.randn(48, 31).bfloat16()) != "blocked"  # odd K: oneDNN (or F.linear)
    assert Linear(w, prepack=False).layout == "plain"
    fp32 = Linear(torch.randn(48, 32, generator=g))  # values off the bf16 grid: no bf16 copy (see _f32's tests)
    assert fp32.layout in ("onednn", "plain") and fp32.wants_row_buckets == (fp32.layout == "onednn")


def test_weights_and_the_kv_cache_past_2_mb_start_on_a_huge_page_boundary():
    from services.engine.quantization import kv_cache

    big = cpu_kernels.huge_page_empty((3, 1 << 20), torch.bfloat16)  # 6 MB
    assert big.shape == (3, 1 << 20) and big.dtype == torch.bfloat16 and big.is_contiguous()
    big.fill_(1.5)  # writable, every page of it
    assert big.sum().item() == 1.5 * 3 * (1 << 20)
    packed = blocked_linear.pack(torch.randn(1290, 1024).bfloat16())
    (k, v), = kv_cache.allocate("auto", 1, (256, 16, 4, 64), torch.bfloat16, torch.device("cpu"))  # 8 MB each
    assert not k.any() and not v.any()
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        for t in (big, packed.words, k, v):
            assert t.data_ptr() % cpu_kernels.HUGE_PAGE == 0
    small = cpu_kernels.huge_page_empty((4, 8), torch.float32)
    assert small.shape == (4, 8) and small.dtype == torch.float32
