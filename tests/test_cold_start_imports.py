"""What a service imports before it serves: every engine start and every gateway start pays for it
(a replica's cold start, and each stack the tests start). Heavy libraries load where they are used."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module, absent", [
    ("services.engine.core_process", ["compressed_tensors"]),  # only to quantize or read quantized weights
    ("services.engine.service", ["compressed_tensors"]),
    ("services.gateway.service", ["compressed_tensors"]),
])
def test_a_service_module_does_not_import_what_it_does_not_need(module, absent):
    code = f"import sys, {module}; print(' '.join(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"
