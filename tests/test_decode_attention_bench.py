"""bench/decode_attention.py's --baseline: the kernel of a git revision, built and timed beside
this tree's. Against HEAD (what a clean checkout builds) both builds must give the same bits."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import decode_attention
from kernels import cpu as cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(cpu_kernels.load() is None or not _in_git_checkout(), reason="needs a C compiler and git")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_baseline_of_head_gives_the_same_bits(tmp_path, dtype):
    out = tmp_path / "attn.json"
    decode_attention.main(["--dtype", dtype, "--cases", "2x40", "--layers", "1", "--repeats", "1",
                           "--baseline", "HEAD", "--out", str(out)])
    results = json.loads(out.read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert results["baseline"] == head  # the commit, not the name it was given by
    rows = results["results"]
    assert [r["shape"] for r in rows] == ["M", "L"]
    for row in rows:
        assert row["same_bits"] is True
        assert row["baseline_us"] > 0 and row["c_call_us"] > 0 and row["speedup"] > 0


@pytest.mark.skipif(not _in_git_checkout(), reason="needs git")
def test_baseline_names_a_missing_revision():
    with pytest.raises(SystemExit, match="no-such-revision-of-strata: not a revision"):
        decode_attention.resolve_revision("no-such-revision-of-strata")
