"""Runs the kernel tests in a fresh Python process (CPU interpreter).

Only kept by conftest.py when triton was imported in this pytest process before
TRITON_INTERPRET=1 could be set (which happens in a full ``pytest tests`` run);
otherwise it is deselected and test_kernels.py runs in-process as usual.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_kernel_tests_in_fresh_process():
    env = dict(os.environ, STRATA_KERNEL_DEVICE="cpu", TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "test_kernels.py"), "-q", "-p", "no:cacheprovider"],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900,
    )
    tail = proc.stdout[-20000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout, tail
