"""Kernel tests run on CPU through the Triton interpreter unless told otherwise.

``STRATA_KERNEL_DEVICE=cuda pytest tests/kernels`` runs the same tests compiled
on the GPU; only for the CPU device is ``TRITON_INTERPRET=1`` forced, and it
must be set before any ``triton.jit`` decoration happens (at import time).
"""

from __future__ import annotations

import importlib
import os
import sys

KERNEL_DEVICE = os.environ.get("STRATA_KERNEL_DEVICE", "cpu")
if KERNEL_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    # If another test module imported `kernels` earlier without the
    # interpreter, its kernels were compiled-mode objects that cannot run on
    # CPU tensors: re-import them (dependencies first) so they are interpreted.
    _utils = sys.modules.get("kernels._utils")
    if _utils is not None and not _utils.INTERPRETED:
        for name in ("kernels._utils", "kernels.reference", "kernels.attention", "kernels.norm",
                     "kernels.rotary", "kernels.activation", "kernels"):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
