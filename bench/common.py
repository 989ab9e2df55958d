"""What the benchmark scripts share: one streamed completion timed, percentiles, the results file."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else 0.0


async def stream_completion(http, stack, prompt: list[int], max_tokens: int, extra: dict | None = None
                            ) -> tuple[float, dict]:
    """POST a streaming completion through the stack's gateway (`extra`: more body fields);
    returns (seconds to the first token, the final usage event: usage and the strata extension)."""
    body = {"model": stack.deployment, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    ttft, final = None, {}
    async with http.post(stack.base_url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["text"] and ttft is None:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                final = event
    return ttft, final


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (saying so) where matplotlib is
    not installed: the figures and JSON do not need it."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no PNG")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(path: str | Path, args: argparse.Namespace, data: dict) -> None:
    """One JSON per script under bench/results/, with the config it ran with."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": vars(args), **data}, indent=2))
    print(f"wrote {path}")


def run_shapes(args: argparse.Namespace, run_shape, plot) -> int:
    """An engine bench over model shapes: `run_shape(key, args)` for each of args.shapes, the
    results to args.out and `plot`'s figure to args.png (default: args.out's path with .png)."""
    args.png = args.png or str(Path(args.out).with_suffix(".png"))
    shapes = {key: run_shape(key, args) for key in args.shapes}
    write_results(args.out, args, {"shapes": shapes})
    plot(shapes, Path(args.png), args)
    return 0


def resolve_revision(rev: str, flag: str = "--baseline") -> str:
    """`rev`'s commit hash (what the results record), or exit naming it."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        sys.exit(f"{flag} {rev}: not a revision of this repository")
    return found.stdout.strip()


def revision_kernel_sources(rev: str, names: tuple[str, ...] | list[str], flag: str = "--baseline") -> Path:
    """A temporary directory holding kernels/cpu/<name> for each of `names` as they were at git
    revision `rev`, or exit naming the one that was not there."""
    tmp = Path(tempfile.mkdtemp(prefix="strata-kernels-"))
    for name in names:
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/cpu/{name}"],
                               capture_output=True, text=True)
        if shown.returncode != 0:
            sys.exit(f"{flag} {rev}: no kernels/cpu/{name} there ({shown.stderr.strip()})")
        (tmp / name).write_text(shown.stdout)
    return tmp
