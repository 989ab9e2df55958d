"""Quantized weights and KV cache on the L shape (Qwen2.5-0.5B shape, bf16 checkpoint): what they
hold and how fast decode runs, every arm side by side in one run.

Arms (each Strata's offline engine in its own process, the same thread count, prefix caching off):
  fp32     dtype=float32 (the issue's baseline)
  bf16     dtype=auto: the checkpoint's bf16 (the fast full-precision path on this CPU)
  int8     quantization=int8 over bf16 activations (W8A16): int8 weights, a scale per output channel
  int4     quantization=int4 (W4A16): int4 weights, a scale per 128 input channels
  (--arms may add int8-fp32 / int4-fp32: the same weights under fp32 activations, W8A32 / W4A32)
The decoder layers' projections are quantized; embedding and lm_head stay bf16 (the tied lm_head is
oneDNN's packed copy of the embedding): the lm_head's 272 MB are read by every decode step whatever
the arm, so the byte ratio (and with it the speed-up) of the whole model is smaller than the layers'.

Decode: B requests of --prompt-len tokens generating --decode-tokens each; tokens/s = B x the decode
steps / their wall time (steps with a prefill in them are left out), at batch 1 and 32. The arms
run interleaved: round r runs every arm in turn, --repeats rounds, the median counts. The machine
is shared: each run records the share of the CPU that other processes took meanwhile, and, as in
bench/engine_realistic.py (its NoiseGuard), first waits for a quiet machine and is redone when
others took more than --max-others-cpu, within --noise-budget seconds for the whole bench (a run
still disturbed after that is kept, marked noisy).

KV cache: at the same memory (--kv-budget-mib), the blocks the bf16 cache and the int8 cache hold,
the sequences of --kv-context tokens they fit, and the most that actually ran at once when
--kv-requests such requests were submitted together (llm.stats() running, each step).

Prints the figures and the issue's targets (int8 >= 1.8x fp32, int4 >= 2.5x fp32 at batch 1);
writes bench/results/quantization.json and bench/results/quantization.png. A GPU is not measured.

    python bench/quantization.py                    # about 5 minutes on 2 cores
    python bench/quantization.py --repeats 1 --decode-tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import pyplot, write_results  # noqa: E402
from bench.runner_protocol import thread_env  # noqa: E402

ARMS = {  # name -> engine arguments
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "auto"},
    "int8": {"dtype": "auto", "quantization": "int8"},
    "int4": {"dtype": "auto", "quantization": "int4"},
    "int8-fp32": {"dtype": "float32", "quantization": "int8"},
    "int4-fp32": {"dtype": "float32", "quantization": "int4"},
}
DEFAULT_ARMS = "fp32,bf16,int8,int4"
TARGETS = {"int8": 1.8, "int4": 2.5}  # decode tokens/s at batch 1 over fp32 (issue 19)
BLOCK_SIZE = 16


# ---------------------------------------------------------------- the runner process


def runner_main(job_path: str) -> None:
    """One arm: load the engine, answer `ready`, then one JSON answer per command on stdin."""
    import torch

    from services.engine import LLM, SamplingParams
    from services.engine.model import LAYER_LINEARS

    job = json.loads(Path(job_path).read_text())
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything else the process prints goes to the log
    start = time.perf_counter()
    llm = LLM(job["model"], max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False,
              block_size=BLOCK_SIZE, num_threads=job["threads"], **job["engine"])
    engine, model = llm.engine, llm.engine.runner.model
    linears = sum(getattr(layer, n).nbytes for layer in model.layers for n in LAYER_LINEARS)
    answers.write(json.dumps({
        "ready": True, "load_s": time.perf_counter() - start, "dtype": str(engine.runner.dtype),
        "weight_bytes": model.weight_bytes(), "layer_linear_bytes": linears, "lm_head_bytes": model.lm_head.nbytes,
        "embed_bytes": model.embed.numel() * model.embed.element_size(),
        "kv_bytes_per_block": engine.runner.kv_bytes_per_block, "total_blocks": engine.block_manager.num_blocks,
        "quantization": llm.stats()["quantization"], "kv_cache_dtype": llm.stats()["kv_cache_dtype"]}) + "\n")
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]

    def decode(batch: int, prompt_len: int, tokens: int) -> dict:
        """Steps until every request is done; only steps without prefill count."""
        started = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
        ids = [f"r{time.monotonic_ns()}-{i}" for i in range(batch)]
        for rid, p in zip(ids, prompts(batch, prompt_len)):
            engine.add_request(rid, p, params)
        wall, steps, forward = 0.0, 0, 0.0
        while engine.has_unfinished_requests():
            decoding = not engine.scheduler.waiting and all(
                s.num_output_tokens >= 1 for s in engine.scheduler.running)
            engine.step()
            if decoding and engine.last_step is not None:
                wall += engine.last_step.wall
                forward += engine.last_step.forward
                steps += 1
        return {"tokens_per_s": batch * steps / wall, "step_ms": 1e3 * wall / steps, "steps": steps,
                "forward_share": forward / wall, "seconds": time.perf_counter() - started}

    def concurrency(requests: int, prompt_len: int, tokens: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for i, p in enumerate(prompts(requests, prompt_len)):
            engine.add_request(f"c{i}", p, params)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, llm.stats()["running"])
        return {"peak_running": peak, "preemptions": llm.stats()["num_preemptions"]}

    decode(1, 8, 4)  # warm-up: kernels built, buffers allocated
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        with torch.inference_mode():
            if cmd["op"] == "decode":
                answers.write(json.dumps(decode(cmd["batch"], cmd["prompt_len"], cmd["tokens"])) + "\n")
            elif cmd["op"] == "concurrency":
                answers.write(json.dumps(concurrency(cmd["requests"], cmd["prompt_len"], cmd["tokens"])) + "\n")


# ---------------------------------------------------------------- the driver


def start(name: str, engine_args: dict, args, log_dir: Path):
    from bench.engine_realistic import RunnerProcess

    job = log_dir / f"{name}.json"
    job.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "engine": engine_args}))
    env = {**os.environ, **thread_env(args.threads)}
    proc = RunnerProcess(name, [sys.executable, __file__, "--runner", str(job)], env, log_dir / f"{name}.log")
    info = proc.read(timeout=1800)
    if not info.get("ready"):
        raise RuntimeError(f"{name} did not load: {proc.log_tail()}")
    return proc, info


def measure(proc, pids: list[int], guard, cmd: dict) -> dict:
    """One run that other processes left alone, as far as the noise budget allows."""
    disturbed = []
    while True:
        guard.wait_for_quiet(pids)
        out = proc.request(cmd, timeout=1800)
        if out["others_cpu"] <= guard.threshold:
            return dict(out, disturbed_runs=len(disturbed), noisy=False)
        disturbed.append(out)
        if not guard.redo(disturbed):
            return dict(min(disturbed, key=lambda a: a["others_cpu"]), disturbed_runs=len(disturbed), noisy=True)


def run_decode(args, log_dir: Path) -> dict:
    from bench.engine_realistic import NoiseGuard

    arms = args.arms.split(",")
    guard = NoiseGuard(args)
    procs, info = {}, {}
    try:
        for name in arms:  # all loaded at once (the L shape: ~2.6 GB in fp32, less for the others)
            engine_args = dict(ARMS[name], num_kv_blocks=args.decode_blocks)
            procs[name], info[name] = start(name, engine_args, args, log_dir)
            print(f"{name}: loaded in {info[name]['load_s']:.1f} s, weights {info[name]['weight_bytes'] / 1e6:.0f} MB",
                  flush=True)
        runs = {name: {str(b): [] for b in args.batches} for name in arms}
        pids = [p.proc.pid for p in procs.values()]
        for r in range(args.repeats):
            for batch in args.batches:
                for name in arms:
                    out = measure(procs[name], pids, guard, {"op": "decode", "batch": batch,
                                                             "prompt_len": args.prompt_len,
                                                             "tokens": args.decode_tokens})
                    runs[name][str(batch)].append(out)
                    print(f"round {r + 1} batch {batch:>2} {name:>9}: {out['tokens_per_s']:7.2f} tok/s "
                          f"({out['step_ms']:.1f} ms/step, others took {out['others_cpu']:.0%} of the CPU, "
                          f"{out['disturbed_runs']} disturbed run(s) redone{'; NOISY' if out['noisy'] else ''})",
                          flush=True)
    finally:
        for proc in procs.values():
            proc.close()
    arms_out = {}
    for name in arms:
        arms_out[name] = {**info[name], "engine_args": ARMS[name], "decode": {
            b: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "noisy_runs": sum(r["noisy"] for r in rs), "runs": rs}
            for b, rs in runs[name].items()}}
    print(f"noise guard: {guard.spent:.0f} s spent waiting for quiet and redoing disturbed runs", flush=True)
    return arms_out


def run_kv(args, log_dir: Path) -> dict:
    """bf16 weights with the bf16 and the int8 cache, at the same KV memory."""
    out = {}
    blocks_per_seq = -(-(args.kv_context) // BLOCK_SIZE)
    for name, kv in (("bf16", "auto"), ("bf16+kv-int8", "int8")):
        budget = args.kv_budget_mib << 20
        proc, info = start(f"kv-{kv}", {"dtype": "auto", "kv_cache_dtype": kv,
                                         "cpu_kv_cache_max_bytes": budget}, args, log_dir)
        try:
            ran = proc.request({"op": "concurrency", "requests": args.kv_requests,
                                "prompt_len": args.kv_context - args.kv_tokens, "tokens": args.kv_tokens},
                               timeout=3600)
        finally:
            proc.close()
        out[name] = {"kv_cache_dtype": kv, "budget_bytes": budget, "kv_bytes_per_block": info["kv_bytes_per_block"],
                     "total_blocks": info["total_blocks"], "context_tokens": args.kv_context,
                     "max_sequences": info["total_blocks"] // blocks_per_seq, **ran}
        print(f"KV {name}: {info['total_blocks']} blocks of {info['kv_bytes_per_block']} B in "
              f"{args.kv_budget_mib} MiB -> {out[name]['max_sequences']} sequences of {args.kv_context} tokens; "
              f"{ran['peak_running']} ran at once", flush=True)
    return out


def report(arms: dict, kv: dict) -> dict:
    ratios = {}
    lines = ["", f"{'arm':>9} {'weights MB':>10} {'layers MB':>9} " +
             " ".join(f"{'b' + b + ' tok/s':>11} {'vs fp32':>7} {'vs bf16':>7}" for b in next(iter(arms.values()))
                      ["decode"])]
    for name, a in arms.items():
        cells = []
        for b, d in a["decode"].items():
            vs = {base: d["tokens_per_s"] / arms[base]["decode"][b]["tokens_per_s"]
                  for base in ("fp32", "bf16") if base in arms}
            ratios.setdefault(name, {})[b] = vs
            cells.append(f"{d['tokens_per_s']:11.2f} " + " ".join(f"{vs.get(base, float('nan')):6.2f}x"
                                                                   for base in ("fp32", "bf16")))
        lines.append(f"{name:>9} {a['weight_bytes'] / 1e6:10.0f} {a['layer_linear_bytes'] / 1e6:9.0f} " + " ".join(cells))
    for name, target in TARGETS.items():
        if name in ratios and "fp32" in arms:
            got = ratios[name]["1"]["fp32"]
            lines.append(f"target {name} decode at batch 1 >= {target}x fp32: {got:.2f}x "
                         f"({'met' if got >= target else 'NOT met'})")
    if len(kv) == 2:
        a, b = kv["bf16"], kv["bf16+kv-int8"]
        lines.append(f"int8 KV: {b['total_blocks'] / a['total_blocks']:.2f}x the blocks of bf16 at the same memory, "
                     f"{b['max_sequences']} vs {a['max_sequences']} sequences of {a['context_tokens']} tokens "
                     f"({b['peak_running']} vs {a['peak_running']} ran at once)")
    lines.append("GPU (bf16 / int8 / int4 / fp8 decode vs HBM peak): not measured (no GPU on this machine)")
    print("\n".join(lines))
    return ratios


def plot(arms: dict, kv: dict, path: Path, threads: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(arms)
    fig, axes = plt.subplots(1, 3 if kv else 2, figsize=(16 if kv else 11, 4.2))
    ax = axes[0]
    layers = [arms[n]["layer_linear_bytes"] / 1e6 for n in names]
    rest = [(arms[n]["weight_bytes"] - arms[n]["layer_linear_bytes"]) / 1e6 for n in names]
    ax.bar(names, layers, label="decoder projections")
    ax.bar(names, rest, bottom=layers, label="embedding, lm_head, norms")
    ax.set_ylabel("MB held")
    ax.set_title("Weight bytes (L shape)")
    ax.legend(fontsize=8)
    ax = axes[1]
    batches = list(arms[names[0]]["decode"])
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        base = arms["fp32"]["decode"][b]["tokens_per_s"] if "fp32" in arms else 1.0
        ax.bar([x + i * width for x in range(len(names))],
               [arms[n]["decode"][b]["tokens_per_s"] / base for n in names], width, label=f"batch {b}")
    ax.set_xticks([x + width * (len(batches) - 1) / 2 for x in range(len(names))], names)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("decode tokens/s over fp32" if "fp32" in arms else "decode tokens/s")
    ax.set_title(f"Decode speed, {threads} threads")
    ax.legend(fontsize=8)
    if kv:
        ax = axes[2]
        kv_names = list(kv)
        ax.bar([x - 0.2 for x in range(len(kv_names))], [kv[n]["total_blocks"] for n in kv_names], 0.4, label="blocks")
        ax2 = ax.twinx()
        ax2.bar([x + 0.2 for x in range(len(kv_names))], [kv[n]["peak_running"] for n in kv_names], 0.4,
                color="tab:orange", label="sequences at once")
        ax.set_xticks(range(len(kv_names)), kv_names)
        ax.set_ylabel("KV blocks")
        ax2.set_ylabel("sequences running at once")
        budget = kv[kv_names[0]]["budget_bytes"] >> 20
        ax.set_title(f"KV cache in {budget} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the L shape)")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=24, help="tokens each request generates")
    parser.add_argument("--decode-blocks", type=int, default=256, help="KV blocks of each decode arm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-budget-mib", type=int, default=16)
    parser.add_argument("--kv-context", type=int, default=64, help="tokens per sequence (prompt + output)")
    parser.add_argument("--kv-tokens", type=int, default=8, help="of which generated")
    parser.add_argument("--kv-requests", type=int, default=48)
    parser.add_argument("--skip-kv", action="store_true")
    parser.add_argument("--max-others-cpu", type=float, default=0.15,
                        help="a decode run during which other processes took more of the CPU is redone")
    parser.add_argument("--max-retries", type=int, default=3, help="disturbed runs redone per run, at most")
    parser.add_argument("--quiet-wait", type=float, default=20,
                        help="seconds to wait, at most, before each run for other processes to leave the CPU")
    parser.add_argument("--noise-budget", type=float, default=300,
                        help="seconds the whole bench may spend waiting for quiet and redoing disturbed runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quantization.json")
    args = parser.parse_args(argv)
    if args.runner:
        return runner_main(args.runner)
    if args.model is None:
        from shared.realistic_models import ensure_model

        args.model = ensure_model("L")
    args.batches = [int(b) for b in args.batches.split(",")]
    log_dir = Path(os.environ.get("STRATA_BENCH_LOGS", "/tmp/strata-bench-quantization"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    arms = run_decode(args, log_dir)
    kv = {} if args.skip_kv else run_kv(args, log_dir)
    ratios = report(arms, kv)
    args.model, args.out = str(args.model), str(args.out)
    write_results(args.out, args, {"arms": arms, "ratios": ratios, "kv_cache": kv, "seconds": time.time() - started,
                                   "gpu": "not measured (no GPU on this machine)"})
    plot(arms, kv, Path(args.out).with_suffix(".png"), args.threads)


if __name__ == "__main__":
    main()
