"""Where the kernel tests run: compiled on CUDA, or on CPU through the Triton interpreter.

``STRATA_KERNEL_DEVICE`` = ``cuda`` or ``cpu``; unset: ``cuda`` when
``torch.cuda.is_available()``, else ``cpu``. Only for ``cpu`` is
``TRITON_INTERPRET=1`` forced, and it only works if set before triton is first
imported: triton decides at decoration time whether a ``@triton.jit`` function
(its own library functions such as ``tl.zeros`` and ``tl.sum`` included) is
interpreted. When another test module imported triton earlier in this process
(e.g. ``from transformers import LlamaForCausalLM`` does, via torch._dynamo),
the kernel tests cannot run in-process on CPU; they are then deselected here and
``test_fresh_process.py`` runs them in a fresh Python process instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RUNNER = "test_fresh_process.py"

KERNEL_DEVICE = os.environ.setdefault("STRATA_KERNEL_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
TRITON_IMPORTED_TOO_EARLY = False
if KERNEL_DEVICE == "cpu":
    TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    ours = [it for it in items if Path(str(it.path)).resolve().parent == HERE]
    if TRITON_IMPORTED_TOO_EARLY:
        drop = [it for it in ours if Path(str(it.path)).name != RUNNER]
    else:
        drop = [it for it in ours if Path(str(it.path)).name == RUNNER]
    if drop:
        dropped = set(map(id, drop))
        items[:] = [it for it in items if id(it) not in dropped]
        config.hook.pytest_deselected(items=drop)
