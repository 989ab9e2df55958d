"""The engine's CPU kernels against those of a git revision, step by step in one engine.

A kernel change worth a few percent of a decode step is lost in this machine's drift between runs
(the same step moves by a third within the hour). Here one engine per shape runs its decode steps
alternately on two builds of kernels/cpu: this tree's (`kernels.cpu.load()`) and the one of
`--baseline REV` (`kernels.cpu.build`, the same flags). Each round adds a batch of requests, runs
its prefill and a few warm-up steps, then `--steps` pairs of decode steps, each pair one step on
either build (the build that goes first flips each round): paired steps share the machine's state
of that moment, and the ratio of their times is the figure. Per batch it reports each build's
median step time and the speed-up (the baseline's step time over this tree's): the median of the
paired steps' ratios, and the ratio of the summed times.

First it checks that the two builds give the same greedy tokens for a short batch, each alone
(`same_tokens` in the results): a kernel change meant to be faster must not change bits.

    python bench/kernels_ab.py --baseline HEAD~1 [--shapes M,L] [--batches 1,16,64] [--rounds 3]

Writes bench/results/kernels_ab.json and a PNG beside it (--out, --png).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import pyplot, resolve_revision, revision_kernel_sources, run_shapes  # noqa: E402
from bench.engine_realistic import parse_ints, parse_list, regular_token_ids  # noqa: E402
from bench.sampled_vs_greedy import WARMUP_STEPS, params, start_batch  # noqa: E402
from kernels import cpu as cpu_kernels  # noqa: E402
from shared.realistic_models import SHAPES, ensure_model  # noqa: E402

BUILDS = ("baseline", "this tree")
CHECK_TOKENS = 8


def baseline_build(rev: str):
    try:
        lib = cpu_kernels.build(revision_kernel_sources(rev, cpu_kernels.SOURCES + cpu_kernels.HEADERS))
    except AttributeError as e:  # a function this tree declares and calls, which that revision lacks
        sys.exit(f"--baseline {rev}: its kernels lack what this tree calls ({e})")
    if lib is None:
        sys.exit(f"--baseline {rev}: its kernels did not build here")
    return lib


def run_batch(llm, prompts: list[list[int]], mode: str, max_tokens: int) -> list[list[int]]:
    """The batch to its end; each request's output token ids."""
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params(mode, len(prompts), max_tokens))]


def paired_steps(llm, prompts: list[list[int]], mode: str, steps: int, libs: dict, first: str) -> dict:
    """One batch: prefill and warm-up on this tree's build, then `steps` pairs of decode steps,
    one step of each pair on each build (`first` runs first); ms per step, build by build."""
    engine = llm.engine
    start_batch(llm, prompts, mode, 2 * steps)
    order = [first, *(b for b in BUILDS if b != first)]
    times = {b: [] for b in BUILDS}
    for _ in range(steps):
        for build in order:
            with cpu_kernels.using(libs[build]):
                start = time.perf_counter()
                engine.step()
                times[build].append((time.perf_counter() - start) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def run_shape(key: str, args, baseline_lib) -> dict:
    from services.engine import LLM

    model_dir = ensure_model(key)
    ids = regular_token_ids(model_dir)
    rng = random.Random(args.seed)
    top = max(args.batches)
    prompts = [[rng.choice(ids) for _ in range(args.prompt_len)] for _ in range(top)]
    llm = LLM(str(model_dir), dtype=args.dtype, num_threads=args.threads, max_num_seqs=top,
              max_model_len=args.prompt_len + WARMUP_STEPS + 2 * args.steps + 16, enable_prefix_caching=False)
    libs = {"baseline": baseline_lib, "this tree": cpu_kernels.load()}
    tokens = {}
    for build in BUILDS:
        with cpu_kernels.using(libs[build]):
            tokens[build] = run_batch(llm, prompts[:min(4, top)], "greedy", CHECK_TOKENS)
    same_tokens = tokens["baseline"] == tokens["this tree"]
    print(f"{key}: greedy tokens of the two builds {'agree' if same_tokens else 'DIFFER'}", flush=True)
    out = {"same_tokens": same_tokens, "fused_decode": llm.engine.runner.model.decode_layers is not None,
           "batches": {}}
    for batch in args.batches:
        pairs = {b: [] for b in BUILDS}
        for r in range(args.rounds):
            got = paired_steps(llm, prompts[:batch], args.mode, args.steps, libs, BUILDS[r % 2])
            for b in BUILDS:
                pairs[b].extend(got[b])
            print(f"{key} b{batch} round {r}: baseline {statistics.median(got['baseline']):7.2f} ms/step, this tree "
                  f"{statistics.median(got['this tree']):7.2f}", flush=True)
        ratios = [a / b for a, b in zip(pairs["baseline"], pairs["this tree"])]
        row = {"baseline_ms": statistics.median(pairs["baseline"]), "this_tree_ms": statistics.median(pairs["this tree"]),
               "speedup": statistics.median(ratios), "speedup_of_sums": sum(pairs["baseline"]) / sum(pairs["this tree"]),
               "speedup_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3,
               "pairs": len(ratios)}
        out["batches"][str(batch)] = row
        print(f"{key} b{batch}: this tree {row['speedup']:.3f}x as fast as {args.baseline[:12]} (median of "
              f"{len(ratios)} paired steps; quartiles {row['speedup_quartiles'][0]:.3f}-"
              f"{row['speedup_quartiles'][2]:.3f}; summed times {row['speedup_of_sums']:.3f}x); step "
              f"{row['this_tree_ms']:.2f} vs {row['baseline_ms']:.2f} ms", flush=True)
    return out


def plot(shapes: dict, path: Path, args) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * sum(len(r["batches"]) for r in shapes.values()) + 2), 4.5))
    labels, mids, lows, highs = [], [], [], []
    for key, res in shapes.items():
        for batch, row in res["batches"].items():
            labels.append(f"{key} b{batch}")
            mids.append(row["speedup"])
            lows.append(row["speedup"] - row["speedup_quartiles"][0])
            highs.append(row["speedup_quartiles"][2] - row["speedup"])
    ax.bar(range(len(mids)), mids, color="tab:blue", yerr=[lows, highs], capsize=4)
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xticks(range(len(mids)), labels)
    ax.set_ylim(min(0.9, min(mids) - 0.05), max(1.1, max(mids) + 0.05))
    ax.set_ylabel("baseline step / this tree's step (median, quartiles)")
    ax.set_title(f"Decode steps, this tree's kernels vs {args.baseline[:12]}'s, paired step by step "
                 f"({args.mode}, {args.threads} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, metavar="REV", help="the git revision whose kernels to compare")
    ap.add_argument("--shapes", type=parse_list(tuple(SHAPES)), default=["M", "L"])
    ap.add_argument("--batches", type=parse_ints, default=[1, 16, 64])
    ap.add_argument("--mode", choices=("greedy", "sampled"), default="greedy")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="pairs of decode steps a round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/kernels_ab.json")
    ap.add_argument("--png", help="default: --out's path with .png")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    if cpu_kernels.load() is None:
        sys.exit("the CPU kernels do not build here (no C compiler?)")
    args.baseline = resolve_revision(args.baseline)
    baseline_lib = baseline_build(args.baseline)
    return run_shapes(args, lambda key, a: run_shape(key, a, baseline_lib), plot)


if __name__ == "__main__":
    sys.exit(main())
