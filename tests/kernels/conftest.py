"""Where the kernel tests run: compiled on CUDA, or on CPU through the Triton interpreter.

``STRATA_KERNEL_DEVICE`` = ``cuda`` or ``cpu`` (default: cuda when available). tests/conftest.py
sets ``TRITON_INTERPRET=1`` for ``cpu`` before triton is first imported: triton decides at
decoration time whether a ``@triton.jit`` function is interpreted.
"""
