"""bench/kernels_ab.py: this tree's CPU kernels against a git revision's, step by step in one
engine; and kernels.cpu's build()/using(), which it runs on."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.cpu import blocked_linear

ROOT = Path(__file__).resolve().parents[1]


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs a C compiler")


@needs_kernels
def test_using_sends_every_call_to_another_build_and_back(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))
    for name in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        shutil.copy(Path(cpu_kernels.__file__).with_name(name), tmp_path / name)
    with (tmp_path / "layer_ops.c").open("a") as f:  # the copy's own marker: which build answered
        f.write("\nint strata_build_marker(void) { return 7; }\n")
    other, mine = cpu_kernels.build(tmp_path), cpu_kernels.load()
    assert other is not None and other is not mine
    x = torch.randn(3, 64)
    packed = blocked_linear.pack(torch.randn(40, 64).bfloat16())
    expected = blocked_linear.linear(x, packed)
    with cpu_kernels.using(other) as lib:
        assert lib is other and cpu_kernels.load() is other and cpu_kernels.load().strata_build_marker() == 7
        assert torch.equal(blocked_linear.linear(x, packed), expected)  # declared as load()'s are
    assert cpu_kernels.load() is mine and not hasattr(mine, "strata_build_marker")
    with pytest.raises(RuntimeError), cpu_kernels.using(other):
        raise RuntimeError("the block failed")
    assert cpu_kernels.load() is mine  # restored however the block ends


@needs_kernels
def test_a_build_that_does_not_compile_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))
    for name in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        (tmp_path / name).write_text("this is not C;\n")
    assert cpu_kernels.build(tmp_path) is None


@pytest.mark.skipif(cpu_kernels.load() is None or not _in_git_checkout(), reason="needs a C compiler and git")
def test_against_head_the_tiny_model_gives_the_same_tokens_and_pairs_every_step(tmp_path, monkeypatch):
    from bench import kernels_ab

    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))  # the tiny model built there
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ab.json"
    assert kernels_ab.main(["--baseline", "HEAD", "--shapes", "S", "--batches", "1,3", "--rounds", "2",
                            "--steps", "3", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert results["config"]["baseline"] == head
    tiny = results["shapes"]["S"]
    assert tiny["same_tokens"] is True
    assert set(tiny["batches"]) == {"1", "3"}
    for row in tiny["batches"].values():
        assert row["pairs"] == 2 * 3
        assert row["baseline_ms"] > 0 and row["this_tree_ms"] > 0 and row["speedup"] > 0
        low, mid, high = row["speedup_quartiles"]
        assert low <= mid <= high


@pytest.mark.skipif(not _in_git_checkout(), reason="needs git")
def test_a_missing_revision_is_named():
    from bench import kernels_ab

    with pytest.raises(SystemExit, match="no-such-revision-of-strata: not a revision"):
        kernels_ab.main(["--baseline", "no-such-revision-of-strata", "--shapes", "S"])
