"""CPU kernels in plain C, compiled on first use with the system C compiler and loaded by ctypes.

No torch headers are involved, so the build takes about a second; the shared object is cached
by source hash under $STRATA_KERNEL_CACHE (default ~/.cache/strata/kernels). Where no compiler
is available, `load()` returns None and callers use their plain torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

SOURCES = ("paged_attention.c", "layer_ops.c", "sampling.c", "quant_linear.c", "lora.c", "prefill_attention.c",
           "blocked_linear.c", "decode_layers.c")
HEADERS = ("strata_math.h", "strata_dot16.h")
# The parts of -ffast-math that let gcc vectorize the dot products and sums, but not -ffast-math
# itself: a shared object built with it sets flush-to-zero for the whole process that loads it
# (crtfastmath), changing everyone's floating point.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC")
# strata_paged_decode_attention_*(q, q_stride, k_cache, v_cache, block_tables, context_lens, out,
# out_stride, batch, heads, kv_heads, head_dim, block_size, max_blocks, scale, threads, k_scales,
# v_scales); bench/decode_attention.py declares another revision's build with it too.
DECODE_ATTENTION_ARGTYPES = ((ctypes.c_void_p, ctypes.c_long) + (ctypes.c_void_p,) * 5 + (ctypes.c_long,)
                             + (ctypes.c_int,) * 6 + (ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p))
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("STRATA_KERNEL_CACHE", Path.home() / ".cache" / "strata" / "kernels"))


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(directory: Path = Path(__file__).parent) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    sources = [directory / name for name in SOURCES]
    source = b"".join((directory / name).read_bytes() for name in SOURCES + HEADERS)
    flags = list(CFLAGS)
    # -march=native: the object is only valid on this CPU model, so the CPU is part of the key.
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"strata_cpu_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                return None
            os.replace(built, target)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(str(target))
    p, i, n, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    for suffix in ("f32", "bf16"):
        for cache in ("", "i8_"):  # caches in the model's dtype, or int8 with their scales
            fn = getattr(lib, f"strata_paged_decode_attention_{cache}{suffix}")
            fn.restype, fn.argtypes = ctypes.c_int, list(DECODE_ATTENTION_ARGTYPES)
        fn = getattr(lib, f"strata_store_kv_{suffix}")
        fn.restype, fn.argtypes = ctypes.c_int, [p, n, p, n, p, n, p, p, n, n]
        fn = getattr(lib, f"strata_rms_norm_{suffix}")
        fn.restype, fn.argtypes = None, [p, n, p, n, p, p, n, n, i, f, i]
        fn = getattr(lib, f"strata_rotary_{suffix}")
        fn.restype, fn.argtypes = None, [p, p, n, i, p, n, i, p, i, n, i]
        fn = getattr(lib, f"strata_silu_and_mul_{suffix}")
        fn.restype, fn.argtypes = None, [p, p, n, i, i]
        fn = getattr(lib, f"strata_argmax_{suffix}")
        fn.restype, fn.argtypes = None, [p, n, n, n, p, i]
        fn = getattr(lib, f"strata_topk_{suffix}")
        fn.restype, fn.argtypes = None, [p, n, n, n, i, i, p, p, p, i]
        fn = getattr(lib, f"strata_sample_rows_{suffix}")
        fn.restype, fn.argtypes = None, [p, n, n, n, p, p, p, p, p, i, p, i]
        fn = getattr(lib, f"strata_logprob_rows_{suffix}")
        fn.restype, fn.argtypes = None, [p, n, n, n, i, p, p, p, p, p, p, i]
        fn = getattr(lib, f"strata_sample_fused_{suffix}")
        fn.restype, fn.argtypes = n, [p, n, n, n, p, n, p, p, n, i, i, p, i]
        fn = getattr(lib, f"strata_qlinear_{suffix}")  # kernels/cpu/quant.py
        fn.restype, fn.argtypes = ctypes.c_int, [p, n, n, p, i, p, i, n, p, p, n, i]
        fn = getattr(lib, f"strata_lora_sgmv_{suffix}")
        fn.restype, fn.argtypes = ctypes.c_int, [p, n, n, p, p, n, n, p, i, n, p, p, p, i, p, n, i]
        fn = getattr(lib, f"strata_prefill_attention_{suffix}")
        fn.restype, fn.argtypes = ctypes.c_int, [p, n, p, p, p, i, p, p, p, n, i, i, i, i, i, f, i]
        fn = getattr(lib, f"strata_decode_layers_{suffix}")  # kernels/cpu/decode_layers.py
        fn.restype, fn.argtypes = ctypes.c_int, [p, i, p]
    lib.strata_blocked_linear_available.restype, lib.strata_blocked_linear_available.argtypes = i, []
    lib.strata_blocked_linear_bf16.restype = i  # kernels/cpu/blocked_linear.py
    lib.strata_blocked_linear_bf16.argtypes = [p, n, n, n, p, n, p, p, n, i, i]
    if hasattr(lib, "strata_amx"):  # an older revision's sources (bench/kernels_ab.py) lack it
        lib.strata_amx.restype, lib.strata_amx.argtypes = i, [i]
        lib.strata_amx(-1)  # AMX tiles wherever the CPU and the OS allow them
    lib.strata_blocked_linear_f32_available.restype, lib.strata_blocked_linear_f32_available.argtypes = i, []
    lib.strata_blocked_linear_f32.restype = i
    lib.strata_blocked_linear_f32.argtypes = [p, n, n, n, p, n, p, p, n, i]
    lib.strata_counter_uniform.restype = ctypes.c_double
    lib.strata_counter_uniform.argtypes = [ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64]
    return lib


HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor starting on a 2 MB boundary, its whole 2 MB spans backed by
    huge pages where the kernel grants them (madvise MADV_HUGEPAGE: Linux's default THP mode,
    "madvise", needs the ask). A decode step streams every weight once and reads KV blocks
    scattered over the cache; with 4 KB pages that is a TLB miss every 4 KB, and the hardware
    prefetchers stop at each page's end (bench/blocked_linear.py --engine: weights and cache in
    huge pages against none). The tail past the last whole span keeps 4 KB pages, so at most
    4 KB is wasted. Falls back to torch.empty below 2 MB or without the advice."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    try:  # private: shared anonymous memory is shmem, whose huge pages are a separate, usually off, setting
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` for the tensor's lifetime
    start = -raw.data_ptr() % HUGE_PAGE  # the pages before it are never touched, so never backed
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KB pages, still aligned
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


# The dtypes the kernels take, and their names' suffix for each.
KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:  # every op asks: no lock once the build is settled (_tried is set after _lib)
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("STRATA_DISABLE_CPU_KERNELS") != "1":
                try:
                    _lib = _build()
                except OSError:
                    _lib = None
            _tried = True
        return _lib


def build(directory: Path) -> ctypes.CDLL | None:
    """The kernels as built from another copy of their sources (SOURCES and HEADERS in
    `directory`, e.g. a git revision's), with load()'s flags and declarations; None where they do
    not compile, AttributeError where they lack a function load()'s declare. For benches that
    compare builds in one process (bench/kernels_ab.py)."""
    return _build(Path(directory))


@contextlib.contextmanager
def using(lib: ctypes.CDLL):
    """Every kernel call inside the block goes to `lib` (a build()), not load()'s: callers look
    their functions up through load() at each call. Not for serving: one engine thread at a time."""
    global _lib
    load()
    previous = _lib
    _lib = lib
    try:
        yield lib
    finally:
        _lib = previous


def amx() -> bool:
    """The bf16 kernels run on AMX tiles (the blocked linear where K is a multiple of 32, prefill
    attention where head_dim is): this CPU has them, the OS let this process use them, and
    `use_amx` did not turn them off."""
    return _amx_state(-1)


def use_amx(on: bool) -> bool:
    """Run the bf16 kernels on AMX tiles (on, where there are) or on AVX512-BF16's vector tiles
    (off); returns whether they run on AMX now. For benches and tests: the two give the same sums
    up to their order, and AMX is used by default wherever it is."""
    return _amx_state(int(on))


def _amx_state(on: int) -> bool:
    """strata_amx(on) of the loaded build (1 asks for the tiles, 0 turns them off, -1 only asks)."""
    lib = load()
    return lib is not None and hasattr(lib, "strata_amx") and lib.strata_amx(on) == 1


def heads_contiguous(t: torch.Tensor) -> bool:
    """A [tokens, heads, head_dim] tensor whose heads are contiguous, with any token stride (a
    view into the fused qkv projection qualifies): the layout the attention and rotary kernels read."""
    return t.dim() == 3 and (not t.shape[0] or (t.stride(2) == 1 and t.stride(1) == t.shape[2]))


def _token_stride(t: torch.Tensor, name: str) -> int:
    """Elements from one token to the next of a heads_contiguous tensor (else a ValueError)."""
    if not heads_contiguous(t):
        raise ValueError(f"{name} must be [tokens, heads, head_dim] with contiguous heads (any token stride)")
    return t.stride(0)


class PagedDecode:
    """One step's decode attention over the paged cache (kernels/cpu/paged_attention.c): the
    block tables and context lengths are checked and converted once, so each layer's call passes
    only its query, caches and output. Same contract as the Triton kernel."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float):
        self.lib = load()
        if self.lib is None:
            raise RuntimeError("CPU kernels unavailable (no C compiler)")
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.context_lens = context_lens.to(torch.int32).contiguous()
        self.batch = self.context_lens.numel()
        self.max_blocks = self.block_tables.shape[1] if self.block_tables.dim() == 2 else 0
        self.scale, self.threads = float(scale), torch.get_num_threads()

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """query [batch, num_heads, head_dim] (fp32 or bf16, heads contiguous, any token stride);
        caches [num_blocks, block_size, num_kv_heads, head_dim] of its dtype, or int8 with their
        fp32 scales [num_blocks, block_size, num_kv_heads]. Writes into `out` (same layout rules)."""
        int8 = k_cache.dtype == torch.int8
        cache_dtype = torch.int8 if int8 else query.dtype
        if (query.dtype not in KERNEL_DTYPES or query.device.type != "cpu" or query.shape[0] != self.batch
                or any(c.dtype != cache_dtype or c.device.type != "cpu" or not c.is_contiguous()
                       for c in (k_cache, v_cache))):
            raise ValueError("paged_decode_attention (CPU) takes fp32 or bf16 CPU tensors of one dtype (or int8 "
                             "caches), one query row per sequence, contiguous caches")
        if int8 and (k_scales is None or v_scales is None or any(
                s.dtype != torch.float32 or not s.is_contiguous() or s.shape != k_cache.shape[:3]
                for s in (k_scales, v_scales))):
            raise ValueError("int8 caches need contiguous fp32 scales of shape [num_blocks, block_size, num_kv_heads]")
        out = torch.empty(query.shape, dtype=query.dtype) if out is None else out
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError("paged_decode_attention (CPU): out must match the query")
        _, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        rc = getattr(self.lib, f"strata_paged_decode_attention_{'i8_' if int8 else ''}{KERNEL_DTYPES[query.dtype]}")(
            query.data_ptr(), _token_stride(query, "query"), k_cache.data_ptr(), v_cache.data_ptr(),
            self.block_tables.data_ptr(), self.context_lens.data_ptr(), out.data_ptr(), _token_stride(out, "out"),
            self.batch, num_heads, num_kv_heads, head_dim, block_size, self.max_blocks, self.scale, self.threads,
            k_scales.data_ptr() if int8 else None, v_scales.data_ptr() if int8 else None)
        if rc != 0:
            raise RuntimeError(f"paged_decode_attention (CPU) failed with code {rc}")
        return out


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache, one call (PagedDecode has the contract)."""
    return PagedDecode(block_tables, context_lens, scale)(query, k_cache, v_cache, out, k_scales, v_scales)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache.view(-1, Hkv, D)[slot_mapping] = k (and v), in one call: k and v [tokens, Hkv, D]
    with contiguous heads and any token stride (views into the fused qkv), caches of their dtype."""
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.dtype in KERNEL_DTYPES
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        raise ValueError("store_kv takes K/V rows and contiguous caches of one fp32 or bf16 dtype, int64 slots")
    row = k_cache.shape[2] * k_cache.shape[3]
    if k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape or slot_mapping.numel() != k.shape[0]:
        raise ValueError("store_kv: one slot per K/V row, rows shaped like the cache's")
    rc = getattr(load(), f"strata_store_kv_{KERNEL_DTYPES[k.dtype]}")(
        k.data_ptr(), _token_stride(k, "k"), v.data_ptr(), _token_stride(v, "v"), slot_mapping.data_ptr(),
        k.shape[0], k_cache.data_ptr(), v_cache.data_ptr(), k_cache.numel() // row, row)
    if rc != 0:
        raise IndexError("store_kv: a slot is outside the cache")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def has_avx512f() -> bool:
    """This CPU has AVX-512 (foundation): the C objects are built for it (-march=native), and
    oneDNN's fp32 kernels are 512 bits wide there."""
    return "avx512f" in _cpu_flags()


def prefill_kernel_vectorized() -> bool:
    """The prefill kernel has micro-kernels for this CPU (the object is built for it): AVX-512, or
    AVX2 with FMA, where it ran 1.26-3.74x as fast as torch's SDPA on a Zen 3 (fp32, 128-4096
    tokens: bench/results/prefill_attention_avx2_fp32_stop45.json). Elsewhere its plain C loops
    run slower than SDPA, so the engine's prefill takes SDPA there."""
    return has_avx512f() or {"avx2", "fma"} <= _cpu_flags()


def paged_prefill_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prefill/extend attention over the paged cache (kernels/cpu/prefill_attention.c):
    query [tokens, num_heads, head_dim] (fp32 or bf16, CPU; heads contiguous, any token stride,
    e.g. a view into the fused qkv output), chunk b's tokens query_start_loc[b]..[b + 1] at
    positions context_lens[b] - qlen .. context_lens[b] - 1, their K/V already in the caches
    [num_blocks, block_size, num_kv_heads, head_dim]. Same contract as
    kernels.reference.paged_prefill_attention_ref. Writes into `out` (same layout rules) if given."""
    lib = load()
    if lib is None:
        raise RuntimeError("CPU kernels unavailable (no C compiler)")
    if query.dtype not in KERNEL_DTYPES or query.device.type != "cpu" or query.dim() != 3:
        raise ValueError("paged_prefill_attention_cpu: query must be a [tokens, heads, head_dim] fp32 or bf16 CPU tensor")
    tokens, num_heads, head_dim = query.shape
    for t in (k_cache, v_cache):
        if t.dtype != query.dtype or t.device.type != "cpu" or t.dim() != 4 or not t.is_contiguous():
            raise ValueError("paged_prefill_attention_cpu: caches must be contiguous 4-d CPU tensors of the query's dtype")
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"paged_prefill_attention_cpu: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not "
                         f"match {num_heads} query heads of head_dim {head_dim}")
    if head_dim % 16 or head_dim > 256:
        raise ValueError(f"paged_prefill_attention_cpu: head_dim must be a multiple of 16 up to 256, got {head_dim}")
    if not scale > 0:
        raise ValueError(f"paged_prefill_attention_cpu: scale must be positive, got {scale}")
    out = torch.empty(query.shape, dtype=query.dtype) if out is None else out
    q_stride, out_stride = _token_stride(query, "query"), _token_stride(out, "out")
    if out.shape != query.shape or out.dtype != query.dtype or out.device.type != "cpu":
        raise ValueError("paged_prefill_attention_cpu: out must match the query")
    block_tables = block_tables.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    batch = context_lens.numel()
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or query_start_loc.numel() != batch + 1:
        raise ValueError("paged_prefill_attention_cpu: block_tables [chunks, max_blocks], query_start_loc "
                         "[chunks + 1] and context_lens [chunks] must agree")
    if batch and (int(query_start_loc[0]) < 0 or int(query_start_loc[-1]) > tokens):
        raise ValueError("paged_prefill_attention_cpu: query_start_loc runs past the query's tokens")
    rc = getattr(lib, f"strata_prefill_attention_{KERNEL_DTYPES[query.dtype]}")(
        query.data_ptr(), q_stride, k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], query_start_loc.data_ptr(), context_lens.data_ptr(), out.data_ptr(), out_stride,
        batch, num_heads, num_kv_heads, head_dim, block_size, float(scale), torch.get_num_threads())
    if rc == -1:
        raise ValueError("paged_prefill_attention_cpu: a chunk has more new tokens than context, a negative length, "
                         "or more blocks than its block table holds")
    if rc != 0:
        raise RuntimeError(f"paged_prefill_attention_cpu failed with code {rc}")
    return out


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a tensor whose last dimension is contiguous and whose leading
    dimensions flatten to one strided axis (views into a fused projection qualify)."""
    if t.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    rows = t.numel() // t.shape[-1] if t.numel() else 0
    for d in range(t.dim() - 2, 0, -1):  # leading dims must nest like a contiguous tensor
        if t.stride(d - 1) != t.stride(d) * t.shape[d]:
            raise ValueError("leading dimensions must flatten to one axis")
    return rows, (t.stride(-2) if t.dim() > 1 else t.shape[-1])


def supports(*tensors: torch.Tensor | None) -> bool:
    """Whether the layer-op kernels take these tensors (CPU, one fp32/bf16 dtype, built); None
    (an absent operand) is taken."""
    t0 = tensors[0]
    return (load() is not None and t0.dtype in KERNEL_DTYPES
            and all(t is None or (t.device.type == "cpu" and t.dtype == t0.dtype) for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension; with `residual`, residual += x first (in place) and the
    norm reads the sum. Returns `out` (a new contiguous tensor unless given; may be x)."""
    lib, hidden = load(), x.shape[-1]
    if out is None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        # The model's rows, twice a layer: the checks kept to what this case needs (each
        # microsecond here is paid 2 x layers times a step).
        if residual is not None and residual.shape != x.shape:
            raise ValueError("residual must match x")
        out = torch.empty_like(x)
        rows, x_stride, out_stride, res_stride = (x.numel() // hidden if hidden else 0), hidden, hidden, hidden
    else:
        if x.stride(-1) != 1 or (x.dim() > 2 and not all(x.stride(d - 1) == x.stride(d) * x.shape[d]
                                                           for d in range(1, x.dim() - 1))):
            x = x.contiguous()  # e.g. per-head norms of a view into the fused qkv
        rows, x_stride = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype) if out is None else out
        out_rows, out_stride = _rows(out)
        res_stride = 0
        if residual is not None:
            res_rows, res_stride = _rows(residual)
            if res_rows != rows:
                raise ValueError("residual must match x")
        if out_rows != rows:
            raise ValueError("rms_norm: shapes do not match")
    if not weight.is_contiguous() or weight.numel() != hidden:
        raise ValueError("rms_norm: shapes do not match")
    getattr(lib, f"strata_rms_norm_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), x_stride, None if residual is None else residual.data_ptr(), res_stride, weight.data_ptr(),
        out.data_ptr(), out_stride, rows, hidden, float(eps), torch.get_num_threads())
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """NeoX rotary embedding of q [tokens, heads, head_dim] and k (same layout) in place."""
    lib = load()
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("positions must be contiguous int64")
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError("the rotary table must be contiguous fp32")
    if k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]:
        raise ValueError("q and k must have the same tokens and head_dim")
    getattr(lib, f"strata_rotary_{KERNEL_DTYPES[q.dtype]}")(
        positions.data_ptr(), q.data_ptr(), _token_stride(q, "q"), q.shape[1], k.data_ptr(), _token_stride(k, "k"),
        k.shape[1], cos_sin.data_ptr(), q.shape[-1], q.shape[0], torch.get_num_threads())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] (SwiGLU over a fused gate/up projection)."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    getattr(load(), f"strata_silu_and_mul_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1] if x.numel() else 0, d, torch.get_num_threads())
    return out


def _logit_rows(x: torch.Tensor) -> int:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("logits must be [rows, vocab] with a contiguous last dimension")
    return x.stride(0)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of [rows, vocab] fp32/bf16 logits, read in place."""
    stride = _logit_rows(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    getattr(load(), f"strata_argmax_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), x.shape[0], x.shape[1], stride, out.data_ptr(), torch.get_num_threads())
    return out


def topk_with_ties(x: torch.Tensor, k: int, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row the k largest values and every value tied with the k-th, sorted descending:
    (values as fp32 [rows, cap], -inf past the count; indices [rows, cap]; counts [rows], -1
    where more than `cap` values qualify). k <= vocab."""
    stride = _logit_rows(x)
    if not 0 < k <= x.shape[1]:
        raise ValueError(f"k must be in [1, {x.shape[1]}], got {k}")
    cap = max(min(cap, x.shape[1]), k)
    values = torch.empty((x.shape[0], cap), dtype=torch.float32)
    indices = torch.empty((x.shape[0], cap), dtype=torch.int64)
    counts = torch.empty(x.shape[0], dtype=torch.int64)
    getattr(load(), f"strata_topk_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), x.shape[0], x.shape[1], stride, k, cap, values.data_ptr(), indices.data_ptr(),
        counts.data_ptr(), torch.get_num_threads())
    return values, indices, counts


def logprob_rows(x: torch.Tensor, n_top: int, targets: torch.Tensor | None = None):
    """Log-softmax facts of [rows, vocab] raw logits (fp32/bf16, read in place: no fp32 copy):
    (log-sum-exp fp32 [rows]; the n_top largest logprobs fp32 [rows, n_top] and their ids,
    descending; and where targets ([rows] ids) is given, each target's logprob fp32 [rows] and
    rank [rows], 1 + how many values exceed it, else None, None)."""
    stride = _logit_rows(x)
    rows = x.shape[0]
    if not 0 <= n_top <= x.shape[1]:
        raise ValueError(f"n_top must be in [0, {x.shape[1]}], got {n_top}")
    lse = torch.empty(rows, dtype=torch.float32)
    values = torch.empty((rows, n_top), dtype=torch.float32)
    ids = torch.empty((rows, n_top), dtype=torch.int64)
    target_logprob = target_rank = None
    if targets is not None:
        targets = targets.to(torch.int64).contiguous().view(-1)
        if targets.numel() != rows or (rows and (int(targets.min()) < 0 or int(targets.max()) >= x.shape[1])):
            raise ValueError("one target id per row, inside the vocabulary")
        target_logprob, target_rank = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.int64)
    getattr(load(), f"strata_logprob_rows_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), rows, x.shape[1], stride, n_top, None if targets is None else targets.data_ptr(),
        lse.data_ptr(), values.data_ptr(), ids.data_ptr(),
        None if targets is None else target_logprob.data_ptr(), None if targets is None else target_rank.data_ptr(),
        torch.get_num_threads())
    return lse, values, ids, target_logprob, target_rank


# One row of sample_fused: sampling.c's strata_sample_row, field for field.
SAMPLE_ROW = np.dtype([
    ("row", np.int64), ("seen_offset", np.int64), ("seed", np.uint64), ("position", np.int64),
    ("temperature", np.float32), ("top_p", np.float32), ("log_min_p", np.float32),
    ("repetition", np.float32), ("frequency", np.float32), ("presence", np.float32),
    ("seen_len", np.int32), ("top_k", np.int32)], align=True)


def sample_fused(x: torch.Tensor, rows: np.ndarray, seen_ids: np.ndarray, seen_counts: np.ndarray,
                 tie_room: int, rounds: int, out: np.ndarray) -> int:
    """Tokens for the sampled rows of [rows, vocab] logits (fp32/bf16), one C pass per row:
    penalties, temperature, top-k (top_k 0: none), top-p and min-p applied and the draw made
    with counter-based uniforms of (seed, position, round). `rows` is a SAMPLE_ROW array, rows
    increasing; a row's seen ids are masked in x while it is read, then restored. out[row]
    (int64, one per logits row) gets each row's token, -1 where a top-k row's ties with the k-th
    value do not fit k + tie_room candidates, a whole row's `rounds` top-p rounds were all
    rejected, or no value is finite; returns how many are -1. seen_ids / seen_counts: int64 /
    fp32, each row's from its seen_offset. The kernel checks rows, top_k, temperatures, seen
    ranges and ids against the tensors before touching any."""
    stride = _logit_rows(x)
    if rows.dtype != SAMPLE_ROW or seen_ids.dtype != np.int64 or seen_counts.dtype != np.float32 \
            or out.dtype != np.int64 or out.size < x.shape[0] \
            or not all(a.flags.c_contiguous for a in (rows, seen_ids, seen_counts, out)):
        raise ValueError("sample_fused: rows as SAMPLE_ROW, seen ids int64, seen counts fp32, out int64 with a "
                         "token per logits row, all contiguous")
    left = getattr(load(), f"strata_sample_fused_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), x.shape[0], x.shape[1], stride, rows.ctypes.data, len(rows), seen_ids.ctypes.data,
        seen_counts.ctypes.data, min(seen_ids.size, seen_counts.size), tie_room, rounds, out.ctypes.data,
        torch.get_num_threads())
    if left == -2:
        raise ValueError("sample_fused: a row, top_k, temperature, seen range or seen id outside its tensor, rows "
                         "not increasing, or rounds outside [1, 64]")
    return left


def counter_uniform(seed: int, position: int, round_: int = 0) -> float:
    """The C kernels' counter-based uniform (the sampler's counter_uniforms, one key)."""
    return load().strata_counter_uniform(seed & (2 ** 64 - 1), position, round_)


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_p: torch.Tensor,
                floor_value: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws over whole rows of [rows, vocab] logits (fp32/bf16, read in place):
    probabilities softmax(x / T) over x >= floor_value (a top-k cut, or -inf), min-p applied,
    top-p by rejection with one uniform per round ([rows, rounds] fp64). -1 for a row whose
    every round was rejected. Per-row parameters are fp32 [rows]."""
    stride = _logit_rows(x)
    rows = x.shape[0]
    params = [t.to(torch.float32).contiguous().view(-1) for t in (temperature, min_p, top_p, floor_value)]
    if any(t.numel() != rows for t in params) or uniforms.shape[0] != rows:
        raise ValueError("one parameter per row")
    uniforms = uniforms.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    getattr(load(), f"strata_sample_rows_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), rows, x.shape[1], stride, *(t.data_ptr() for t in params), uniforms.data_ptr(),
        uniforms.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def lora_sgmv(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, slice_cols: torch.Tensor,
              groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """out[t] += x[t] @ A[s].T @ B[s] in place for the tokens of each group (kernels/cpu/lora.c
    has the layout: B block-diagonal per slice, slice i's columns slice_cols[i]..[i+1]).
    groups: (tokens, group_starts, group_slots), int64: the tokens of group g are
    tokens[group_starts[g]:group_starts[g + 1]] and use slot group_slots[g]. Returns out."""
    lib = load()
    if lib is None:
        raise RuntimeError("CPU kernels unavailable (no C compiler)")
    tokens, starts, slots = groups
    slots_n, rows, fan_in = a_stack.shape
    fan_out = b_stack.shape[2]
    if not (x.dtype == a_stack.dtype == b_stack.dtype == out.dtype and x.dtype in KERNEL_DTYPES):
        raise ValueError("lora_sgmv takes x, A, B and out of one fp32 or bf16 dtype")
    if (x.dim() != 2 or x.shape[1] != fan_in or x.stride(1) != 1 or out.dim() != 2 or out.shape[1] != fan_out
            or out.stride(1) != 1 or not (a_stack.is_contiguous() and b_stack.is_contiguous())
            or b_stack.shape[:2] != (slots_n, rows)):
        raise ValueError("lora_sgmv: x [tokens, in], A [slots, rows, in], B [slots, rows, out] and out "
                         "[tokens, out] must match, with contiguous rows")
    n_slices = slice_cols.numel() - 1
    if n_slices < 1 or rows % n_slices:
        raise ValueError("lora_sgmv: slice_cols must hold a bound per slice of A's rows, and 0")
    for t in (tokens, starts, slots, slice_cols):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("lora_sgmv: groups and slice_cols must be contiguous int64 CPU tensors")
    rc = getattr(lib, f"strata_lora_sgmv_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), x.stride(0), fan_in, a_stack.data_ptr(), b_stack.data_ptr(), rows, rows // n_slices,
        slice_cols.data_ptr(), n_slices, fan_out, tokens.data_ptr(), starts.data_ptr(), slots.data_ptr(),
        slots.numel(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lora_sgmv (CPU) failed with code {rc}")
    return out
