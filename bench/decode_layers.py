"""The fused CPU decode step (kernels/cpu/decode_layers.c: every layer in one C call) against the
same engine run op by op (`fuse_cpu_decode=False`), side by side in one process.

Two engines of the same model, one with each setting, run the same greedy batch in turn for
`--rounds` rounds (the order flips each round); each times `--steps` decode steps after the
prefill and a few warm-up steps (bench/sampled_vs_greedy.py's timed_steps). Per batch size it
reports ms per step and per forward of each, and the speedup (op-by-op step time over fused),
the median over rounds.

    python bench/decode_layers.py [--shapes M,L] [--batches 1,4,16,64] [--rounds 3] [--steps 20]

Writes bench/results/decode_layers.json and a PNG beside it (--out, --png).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import pyplot, run_shapes  # noqa: E402
from bench.engine_realistic import parse_ints, parse_list, regular_token_ids  # noqa: E402
from bench.sampled_vs_greedy import WARMUP_STEPS, timed_steps  # noqa: E402
from shared.realistic_models import SHAPES, ensure_model  # noqa: E402

SETTINGS = {"fused": True, "op-by-op": False}


def run_shape(key: str, args) -> dict:
    from services.engine import LLM

    model_dir = ensure_model(key)
    ids = regular_token_ids(model_dir)
    rng = random.Random(args.seed)
    top = max(args.batches)
    prompts = [[rng.choice(ids) for _ in range(args.prompt_len)] for _ in range(top)]
    engines = {name: LLM(str(model_dir), dtype=args.dtype, num_threads=args.threads, max_num_seqs=top,
                         max_model_len=args.prompt_len + WARMUP_STEPS + args.steps + 16,
                         enable_prefix_caching=False, fuse_cpu_decode=fuse) for name, fuse in SETTINGS.items()}
    if engines["fused"].engine.runner.model.decode_layers is None:
        raise SystemExit(f"{key}: this model and CPU do not take the fused decode step (no blocked weights here)")
    for llm in engines.values():
        timed_steps(llm, prompts[:1], "greedy", 2)  # first-use costs out of the figures
    out = {}
    for batch in args.batches:
        rounds = []
        for r in range(args.rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
            got = {name: timed_steps(engines[name], prompts[:batch], "greedy", args.steps) for name in order}
            got["speedup"] = got["op-by-op"]["step_ms"] / got["fused"]["step_ms"]
            rounds.append(got)
            print(f"{key} b{batch} round {r}: fused {got['fused']['step_ms']:6.2f} ms/step (forward "
                  f"{got['fused']['forward_ms']:6.2f}), op by op {got['op-by-op']['step_ms']:6.2f} (forward "
                  f"{got['op-by-op']['forward_ms']:6.2f}): {got['speedup']:.3f}x", flush=True)
        speedups = [r["speedup"] for r in rounds]
        median = {name: {f: statistics.median(r[name][f] for r in rounds) for f in rounds[0][name]} for name in SETTINGS}
        out[str(batch)] = {"rounds": rounds, "median": median, "speedup": statistics.median(speedups),
                           "speedup_range": [min(speedups), max(speedups)]}
        print(f"{key} b{batch}: fused step {statistics.median(speedups):.3f}x as fast as op by op (median of "
              f"{len(rounds)} rounds, {min(speedups):.3f}-{max(speedups):.3f}); step "
              f"{median['fused']['step_ms']:.2f} vs {median['op-by-op']['step_ms']:.2f} ms", flush=True)
    return out


def plot(shapes: dict, path: Path, args) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(max(7, 6 * len(shapes)), 4.5), squeeze=False)
    for ax, (key, res) in zip(axes[0], shapes.items()):
        batches = list(res)
        x = range(len(batches))
        for i, (name, colour) in enumerate(zip(SETTINGS, ("tab:blue", "tab:gray"))):
            ax.bar([j + (i - 0.5) * 0.38 for j in x], [res[b]["median"][name]["step_ms"] for b in batches], 0.38,
                   color=colour, label=name)
        ax.set_xticks(list(x), [f"batch {b}\n{res[b]['speedup']:.2f}x" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("ms per decode step (median of rounds)")
        ax.set_title(f"{key}: decode step, fused vs op by op")
        ax.legend(fontsize=8)
    fig.suptitle(f"One C call for the layers vs one call per op, {args.dtype}, {args.threads} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=parse_list(tuple(SHAPES)), default=["M", "L"])
    ap.add_argument("--batches", type=parse_ints, default=[1, 4, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/decode_layers.json")
    ap.add_argument("--png", help="default: --out's path with .png")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    return run_shapes(args, run_shape, plot)


if __name__ == "__main__":
    sys.exit(main())
