"""CPU kernels in plain C, compiled on first use with the system C compiler and loaded by ctypes.

No torch headers are involved, so the build takes about a second; the shared object is cached
by source hash under $STRATA_KERNEL_CACHE (default ~/.cache/strata/kernels). Where no compiler
is available, `load()` returns None and callers use their plain torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("paged_attention.c")
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


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    source = _SOURCE.read_bytes()
    # The parts of -ffast-math that let gcc vectorize the dot products and sums, but not
    # -ffast-math itself: a shared object built with it sets flush-to-zero for the whole process
    # that loads it (crtfastmath), changing everyone's floating point.
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
             "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC"]
    # -march=native: the object is only valid on this CPU model, so the CPU is part of the key.
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"strata_cpu_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                return None
            os.replace(built, target)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(str(target))
    for fn in (lib.strata_paged_decode_attention_f32, lib.strata_paged_decode_attention_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


# Cache dtypes the decode kernel reads, and its entry point for each.
DECODE_DTYPES = {torch.float32: "strata_paged_decode_attention_f32",
                 torch.bfloat16: "strata_paged_decode_attention_bf16"}


def load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("STRATA_DISABLE_CPU_KERNELS") != "1":
                try:
                    _lib = _build()
                except OSError:
                    _lib = None
        return _lib


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache (fp32 or bf16 CPU tensors, all of one dtype); same
    contract as the Triton kernel."""
    lib = load()
    if lib is None:
        raise RuntimeError("CPU kernels unavailable (no C compiler)")
    for t in (query, k_cache, v_cache):
        if t.dtype != query.dtype or t.dtype not in DECODE_DTYPES or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("paged_decode_attention (CPU) takes contiguous fp32 or bf16 CPU tensors of one dtype")
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query) if out is None else out
    rc = getattr(lib, DECODE_DTYPES[query.dtype])(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size,
        block_tables.shape[1] if block_tables.dim() == 2 else 0, float(scale), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention (CPU) failed with code {rc}")
    return out
