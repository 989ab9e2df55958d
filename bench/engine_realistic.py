"""The engine at real scale: Strata vs vLLM's CPU build vs Hugging Face, on realistic model shapes.

Shapes (shared/realistic_models.py; random weights, a real BPE tokenizer of the model's vocabulary,
built once under STRATA_HOME/models): S the tiny Llama (vocab 4096), M a 56M Llama (hidden 512,
8 layers, vocab 32,000), L the Qwen2.5-0.5B shape (hidden 896, 24 layers, vocab 151,936).

Runners, each in its own process, with the same thread count, dtype, KV budget and prompts:
  strata     Strata's offline LLM (services.engine), prefix caching off
  vllm       vLLM's CPU build, in its own venv (--vllm-venv / STRATA_VLLM_VENV; skipped, saying so, when
             absent): VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CPU_KVCACHE_SPACE=the KV budget, its OpenMP
             threads bound to cores 0..threads-1 (VLLM_CPU_OMP_THREADS_BIND), prefix caching off
  hf-static  transformers generate in static batches of max_num_seqs (left padding)
  hf-cb      transformers' continuous batching (the manager behind generate_batch)
Modes: greedy, and sampled (temperature 0.8, top_p 0.95, top_k 50, repetition_penalty 1.1; request i
has seed 1000 + i in Strata; vLLM without seeds, which fail on its CPU build; HF static seeds each
batch; HF continuous batching seeds the run and cannot apply repetition_penalty). Every request
ignores EOS.

Workloads (token-id prompts drawn from the tokenizer's regular tokens, the same for every runner):
  throughput   N requests at once, prompt and output lengths uniform in ranges: output tokens/s
  prefill-P    prompts of P tokens (as many as fit in --prefill-tokens, at least one), 1 output token:
               prompt tokens/s
  decode-bB    B requests of --decode-prompt-len tokens and --decode-tokens output tokens each: decode
               tokens/s over the steps in which all B were decoding, timed step by step inside the run
               (bench/runner_protocol.py's StepClock), so the prefill stays out of it at any prompt length
Timing is the same for every runner (bench/runner_protocol.py): generation only, after a warm-up of
each mode; model load and warm-up reported apart. Where memory allows all runners at once
(--interleave auto; at L it does not on a 24 GB machine), runs are interleaved (for each mode and
workload, every runner in turn) so that the machine's noise falls on all of them alike; otherwise
one runner after the other. Each point runs --repeats times (per shape by default) and the median
counts. The development machines are shared, so every run waits (up to --quiet-wait s) for other
processes to leave the CPU and records the share they took meanwhile; a run they took more than
--max-others-cpu of is redone (up to --max-retries times; the waiting and redoing together spend at
most --noise-budget seconds of the whole bench; if every attempt was disturbed, the least disturbed
counts and the point is reported as noisy). Also Strata's step-phase split (its StepTimings) over
each decode point's decode steps.

Prints the figures and ratios (Strata/vLLM, Strata/HF, sampled/greedy) with issue 16's targets;
writes bench/results/engine_realistic.json (after every shape) and bench/results/engine_realistic.png.

    python bench/engine_realistic.py                          # everything (about 75 minutes on 2 cores)
    python bench/engine_realistic.py --shapes S,M --quick     # a few minutes
    python bench/engine_realistic.py --shapes L --runners strata,vllm --decode-batches 32,64
    python bench/engine_realistic.py --device cuda --shapes M,L --runners strata,hf-static,hf-cb  # a GPU, bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import pyplot, write_results  # noqa: E402
from bench.runner_protocol import thread_env  # noqa: E402
from shared.realistic_models import SHAPES, ensure_model  # noqa: E402

RUNNERS = ("strata", "vllm", "hf-static", "hf-cb")
MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1, "seed": 1000},
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PHASES = ("schedule", "prepare", "forward", "sample", "detokenize", "bookkeeping", "other")
DEFAULT_VLLM_VENV = "/work/peer/vllm-venv"
# Issue 16's targets on this CPU.
TARGET_VS_VLLM, TARGET_VS_HF_STATIC, TARGET_SAMPLED_OVER_GREEDY, TARGET_SAMPLE_SHARE = 1.0, 2.0, 0.85, 0.10
MIN_WATCH_S = 0.5  # the shortest window over which other processes' CPU share is measured
# A decode point counts only when its window holds at least this many decode steps.
MIN_DECODE_STEPS = 8


@dataclass
class Sizes:
    requests: int  # throughput workload
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    prefill_lens: tuple[int, ...] = (128, 512, 2048)
    prefill_tokens: int = 2048  # prompts per prefill point: max(1, prefill_tokens // P)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    decode_prompt_len: int = 128
    decode_tokens: int = 32
    repeats: int = 3  # runs of each point; the median counts


# Sized so that the whole run takes about an hour on 2 cores (L dominates: ~40 minutes). A decode
# point's rate is timed over its decode steps only, 63 of them at 64 output tokens.
FULL = {
    "S": Sizes(128, (16, 512), (16, 256), decode_tokens=64),
    "M": Sizes(64, (16, 512), (16, 256), decode_tokens=64),
    "L": Sizes(24, (16, 256), (16, 64), decode_prompt_len=64, decode_tokens=64, repeats=1),
}
QUICK = {
    key: Sizes(16, (16, 128), (8, 32), prefill_lens=(128, 512), prefill_tokens=512, decode_batches=(1, 16, 64),
               decode_prompt_len=64, decode_tokens=32, repeats=2 if key != "L" else 1)
    for key in SHAPES
}


# ---------------------------------------------------------------- workloads


def regular_token_ids(model_dir: Path) -> list[int]:
    """Token ids a prompt may hold: the vocabulary without the special tokens."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    special = {t["id"] for t in tok.get("added_tokens", [])}
    return [i for i in range(config["vocab_size"]) if i not in special]


def make_workloads(sizes: Sizes, ids: list[int], max_model_len: int, seed: int) -> tuple[list[dict], dict]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.choice(ids) for _ in range(n)]

    lens = [rng.randint(*sizes.prompt_len) for _ in range(sizes.requests)]
    workloads = [{"name": "throughput", "prompts": [prompt(n) for n in lens],
                  "max_tokens": [rng.randint(*sizes.output_len) for _ in lens]}]
    for length in sizes.prefill_lens:
        n = min(length, max_model_len - 1)  # one output token must fit
        count = max(1, sizes.prefill_tokens // length)
        workloads.append({"name": f"prefill-{length}", "prompts": [prompt(n) for _ in range(count)],
                          "max_tokens": [1] * count})
    for batch in sizes.decode_batches:
        prompts = [prompt(sizes.decode_prompt_len) for _ in range(batch)]
        workloads.append({"name": f"decode-b{batch}", "prompts": prompts, "max_tokens": [sizes.decode_tokens] * batch,
                          "decode_batch": batch})
    max_seqs = max(64, *sizes.decode_batches)
    warmup = {"prompts": [prompt(16) for _ in range(max_seqs)] + [prompt(min(300, max_model_len - 8))],
              "max_tokens": [4] * (max_seqs + 1)}
    return workloads, warmup


# ---------------------------------------------------------------- runner processes


def cpu_model() -> dict:
    """The CPU's name and the vector extensions that decide which kernels run (ratios differ by them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": platform.processor()}
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", platform.processor()),
            "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})}


def gpu_model(device: str) -> dict:
    """The GPU's name and memory, and the torch/CUDA versions, when the runners run on one."""
    if device == "cpu":
        return {}
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__, "cuda": torch.version.cuda}


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def process_cpu_ticks(pid: int) -> int:
    """User + system ticks of a process and its waited-for children, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    except OSError:
        return 0


class RunnerProcess:
    """One runner in its own process (bench/runner_protocol.py); every wait has a timeout."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env, text=True, cwd=ROOT)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self.error: str | None = None

    def read(self, timeout: float) -> dict:
        if not self.selector.select(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the process exited ({self.proc.wait(10)}); log tail:\n{self.log_tail()}")
        return json.loads(line)

    def request(self, cmd: dict, timeout: float) -> dict:
        """Send a command and wait for its answer; the answer gets `others_cpu`: the share of the
        machine's CPU time that other processes took meanwhile (this machine is shared: a run with a
        high share was slowed by someone else)."""
        start, before = time.monotonic(), (machine_cpu_ticks(), process_cpu_ticks(self.proc.pid))
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self.read(timeout)
        # A short run spans a few clock ticks only: watch the machine a little longer to judge it.
        time.sleep(max(0.0, MIN_WATCH_S - (time.monotonic() - start)))
        (busy, total), own = machine_cpu_ticks(), process_cpu_ticks(self.proc.pid)
        if total > before[0][1]:
            answer["others_cpu"] = max(0.0, (busy - before[0][0] - (own - before[1])) / (total - before[0][1]))
        return answer

    def log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.selector.close()
        self.log.close()


def vllm_python(venv: str) -> tuple[Path | None, str]:
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        return None, f"no vLLM venv at {venv} (set --vllm-venv or STRATA_VLLM_VENV)"
    if not list((Path(venv) / "lib").glob("python*/site-packages/vllm/__init__.py")):
        return None, f"{venv} has no vllm package"
    return python, ""


def runner_command(name: str, job_path: Path, args) -> tuple[list[str], dict]:
    env = dict(os.environ, **thread_env(args.threads))
    if name == "vllm":  # its own venv: nothing of Strata's on its path
        env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        python, _ = vllm_python(args.vllm_venv)
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpu_bind or (
                        "0" if args.threads == 1 else f"0-{args.threads - 1}")})
        return [str(python), str(ROOT / "bench" / "engine_realistic_vllm.py"), name, str(job_path)], env
    return [sys.executable, str(ROOT / "bench" / "engine_realistic_runners.py"), name, str(job_path)], env


# ---------------------------------------------------------------- one shape


def available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def start_runners(names: list[str], key: str, job_path: Path, args, log_dir: Path, result: dict) -> dict:
    """Start each runner and wait for it to load, one at a time so that load times do not contend."""
    procs: dict[str, RunnerProcess] = {}
    for name in names:
        argv, env = runner_command(name, job_path, args)
        proc = RunnerProcess(name, argv, env, log_dir / f"{key}-{name}.log")
        try:
            ready = proc.read(args.load_timeout)
        except (TimeoutError, RuntimeError, ValueError) as exc:
            ready = {"ready": False, "error": str(exc)}
        if not ready.get("ready"):
            result["skipped"][name] = f"did not load: {ready.get('error')}"
            print(f"  {name}: did not load: {ready.get('error')} (log {proc.log_path})", flush=True)
            proc.close()
            continue
        procs[name] = proc
        result["runners"][name] = {"load_s": ready["load_s"], "notes": ready["notes"], "warmup_s": {}}
        print(f"  {name}: loaded in {ready['load_s']:.1f} s" +
              (f" ({'; '.join(ready['notes'])})" if ready["notes"] else ""), flush=True)
    return procs


def others_share(pids: list[int], window: float = 1.0) -> float:
    """The share of the machine's CPU that processes other than `pids` take over `window` seconds."""
    (busy0, total0), own0 = machine_cpu_ticks(), sum(process_cpu_ticks(p) for p in pids)
    time.sleep(window)
    (busy1, total1), own1 = machine_cpu_ticks(), sum(process_cpu_ticks(p) for p in pids)
    return max(0.0, (busy1 - busy0 - (own1 - own0)) / max(1, total1 - total0))


class NoiseGuard:
    """Spends a bounded budget (--noise-budget seconds for the whole bench) on waiting for other processes
    to leave the CPU before a run and on redoing runs they disturbed; once it is spent, runs go ahead
    as they come and are only marked."""

    def __init__(self, args):
        self.threshold = args.max_others_cpu
        self.budget, self.per_wait, self.max_retries = args.noise_budget, args.quiet_wait, args.max_retries
        self.spent = 0.0

    def wait_for_quiet(self, pids: list[int]) -> None:
        start = time.monotonic()
        while self.spent + (time.monotonic() - start) < self.budget and time.monotonic() - start < self.per_wait:
            if others_share(pids) <= self.threshold:
                break
        self.spent += time.monotonic() - start

    def redo(self, disturbed: list[dict]) -> bool:
        """Whether to redo a point after its disturbed runs (charging the last one to the budget)."""
        self.spent += disturbed[-1]["seconds"]
        return len(disturbed) <= self.max_retries and self.spent < self.budget


def measure_point(proc: RunnerProcess, procs: dict[str, RunnerProcess], workload: str, mode: str, repeats: int,
                  guard: NoiseGuard, run_timeout: float) -> dict:
    """`repeats` runs of one point that other processes left alone, as far as the noise budget allows
    (each run first waits for a quiet machine; a run during which others took more than --max-others-cpu
    is redone); the median counts. With no undisturbed run, the least disturbed counts, marked noisy."""
    kept, disturbed = [], []
    while len(kept) < repeats:
        guard.wait_for_quiet([p.proc.pid for p in procs.values()])
        answer = proc.request({"op": "run", "workload": workload, "mode": mode}, run_timeout)
        if "error" in answer:
            return answer
        if answer["others_cpu"] <= guard.threshold:
            kept.append(answer)
            continue
        disturbed.append(answer)
        if not guard.redo(disturbed):
            break
    runs = kept or [min(disturbed, key=lambda a: a["others_cpu"])]
    answer = dict(runs[-1])
    answer.update(seconds=statistics.median(a["seconds"] for a in runs), seconds_all=[a["seconds"] for a in runs],
                  others_cpu=max(a["others_cpu"] for a in runs), disturbed_runs=len(disturbed), noisy=not kept)
    if "decode_s" in answer:
        rates = [a["decode_tokens"] / a["decode_s"] for a in runs]
        answer.update(decode_tok_s=statistics.median(rates), decode_tok_s_all=rates)
    return answer


def run_workloads(procs: dict[str, RunnerProcess], modes: dict, workloads: list[dict], repeats: int,
                  guard: NoiseGuard, args, result: dict) -> None:
    """For each mode and workload, every runner in turn; a runner whose process dies or hangs is dropped."""
    for mode in modes:
        for workload in [w["name"] for w in workloads]:
            for name in list(procs):
                try:
                    answer = measure_point(procs[name], procs, workload, mode, repeats, guard, args.run_timeout)
                except (TimeoutError, RuntimeError, ValueError) as exc:
                    answer = {"error": str(exc)}
                    procs.pop(name).close()
                    result["skipped"][name] = f"stopped at {mode} {workload}: {exc}"
                if "error" in answer:
                    print(f"  {mode:7s} {workload:18s} {name:9s} ERROR {answer['error']}", flush=True)
                    result["runs"][mode][workload][name] = {"error": answer["error"]}
                    continue
                result["runners"][name]["warmup_s"][mode] = answer.pop("warmup_s")
                result["runs"][mode][workload][name] = answer
                decode = (f"  decode {answer['decode_tok_s']:7.1f} tok/s over {answer['decode_steps']} steps"
                          if "decode_tok_s" in answer else "")
                print(f"  {mode:7s} {workload:18s} {name:9s} {answer['seconds']:8.2f} s  "
                      f"{answer['output_tokens']:6d} out  {answer['prompt_tokens']:7d} prompt tokens{decode}  (others "
                      f"{answer['others_cpu']:.0%} of the CPU{'; NOISY' if answer['noisy'] else ''}"
                      + (f"; {answer['disturbed_runs']} disturbed runs redone" if answer["disturbed_runs"] else "")
                      + ")", flush=True)


def run_shape(key: str, sizes: Sizes, runners: list[str], skipped: dict[str, str], guard: NoiseGuard, args,
              log_dir: Path) -> dict:
    shape = SHAPES[key]
    model_dir = ensure_model(key)
    config = json.loads((model_dir / "config.json").read_text())
    longest = max(sizes.prompt_len[1] + sizes.output_len[1], max(sizes.prefill_lens) + 1,
                  sizes.decode_prompt_len + sizes.decode_tokens, 320)
    max_model_len = min(config["max_position_embeddings"], -(-longest // 256) * 256)
    workloads, warmup = make_workloads(sizes, regular_token_ids(model_dir), max_model_len, args.seed)
    modes = {m: MODES[m] for m in args.modes}
    job = {"model": str(model_dir), "threads": args.threads, "dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib,
           "sampler_backend": args.strata_sampler_backend,
           "max_num_seqs": max(64, *sizes.decode_batches), "max_num_batched_tokens": args.max_num_batched_tokens,
           "max_model_len": max_model_len, "modes": modes, "workloads": workloads, "warmup": warmup,
           "run_timeout_s": args.run_timeout, "vllm_enforce_eager": args.vllm_enforce_eager, "device": args.device}
    job_path = log_dir / f"job-{key}.json"
    job_path.write_text(json.dumps(job))
    print(f"\n== {key}: {config['architectures'][0]}, {shape.num_params() / 1e6:.1f}M parameters, vocab "
          f"{config['vocab_size']:,}, hidden {config['hidden_size']}, {config['num_hidden_layers']} layers "
          f"({model_dir}); max_model_len {max_model_len} ==", flush=True)

    result = {"model": str(model_dir), "params": shape.num_params(), "shape": dataclasses.asdict(shape),
              "sizes": dataclasses.asdict(sizes), "max_model_len": max_model_len, "runners": {},
              "skipped": dict(skipped), "runs": {m: {w["name"]: {} for w in workloads} for m in modes}}
    interleave = args.interleave
    if interleave == "auto" and args.device != "cpu":  # GPU memory holds every runner's weights and KV budget
        interleave = "yes"
    if interleave == "auto":  # every runner holds the weights (and a copy or two while loading) and the KV budget
        need = len(runners) * (shape.num_params() * DTYPE_BYTES[args.dtype] * 2 + (args.kv_cache_gib << 30))
        interleave = "yes" if need < 0.7 * available_memory() else "no"
        if interleave == "no":
            print(f"  one runner at a time: {len(runners)} at once would need about {need / 2**30:.0f} GiB of "
                  f"{available_memory() / 2**30:.0f} GiB available", flush=True)
    result["interleaved"] = interleave == "yes"
    for group in ([runners] if interleave == "yes" else [[r] for r in runners]):
        procs = start_runners(group, key, job_path, args, log_dir, result)
        try:
            run_workloads(procs, modes, workloads, sizes.repeats, guard, args, result)
        finally:
            for proc in procs.values():
                proc.close()
    others = [run["others_cpu"] for runs in result["runs"].values() for per_runner in runs.values()
              for run in per_runner.values() if "others_cpu" in run]
    result["others_cpu"] = {"median": statistics.median(others), "max": max(others)} if others else {}
    result["figures"] = figures(result, sizes, list(modes))
    result["ratios"] = ratios(result["figures"], list(modes))
    result["strata_decode_phases"] = strata_phases(result, sizes, list(modes))
    return result


# ---------------------------------------------------------------- figures


def _run(result: dict, mode: str, workload: str, runner: str) -> dict | None:
    run = result["runs"][mode].get(workload, {}).get(runner)
    return run if run and "error" not in run else None


def figures(result: dict, sizes: Sizes, modes: list[str]) -> dict:
    """tokens/s per mode and runner: throughput (output), prefill by prompt length, decode by batch."""
    out = {}
    for mode in modes:
        # decode_share: the decode window's share of each decode point's run (the rest is its prefill)
        fig = {"throughput": {}, "prefill": {}, "decode": {}, "decode_share": {}, "unreliable": [],
               "noisy": sorted(f"{runner} {workload}" for workload, per_runner in result["runs"][mode].items()
                               for runner, run in per_runner.items() if run.get("noisy"))}
        for runner in result["runners"]:
            if run := _run(result, mode, "throughput", runner):
                fig["throughput"][runner] = run["output_tokens"] / run["seconds"]
            for length in sizes.prefill_lens:
                if run := _run(result, mode, f"prefill-{length}", runner):
                    fig["prefill"].setdefault(str(length), {})[runner] = run["prompt_tokens"] / run["seconds"]
            for batch in sizes.decode_batches:
                if not (run := _run(result, mode, f"decode-b{batch}", runner)):
                    continue
                fig["decode_share"].setdefault(str(batch), {})[runner] = round(run["decode_s"] / run["seconds"], 3)
                if run["decode_steps"] < MIN_DECODE_STEPS:
                    fig["unreliable"].append(f"{runner} decode b{batch}: {run['decode_steps']} decode steps")
                    continue
                fig["decode"].setdefault(str(batch), {})[runner] = run["decode_tok_s"]
        out[mode] = fig
    return out


def ratios(figs: dict, modes: list[str]) -> dict:
    def against(values: dict) -> dict:
        base = values.get("strata")
        return {f"strata/{other}": base / values[other] for other in ("vllm", "hf-static", "hf-cb")
                if base and values.get(other)}

    out: dict = {}
    for mode in modes:
        fig = figs[mode]
        out[mode] = {"throughput": against(fig["throughput"]),
                     "prefill": {k: against(v) for k, v in fig["prefill"].items()},
                     "decode": {k: against(v) for k, v in fig["decode"].items()}}
    if "greedy" in figs and "sampled" in figs:
        def over(sampled: dict, greedy: dict) -> dict:
            return {r: sampled[r] / greedy[r] for r in sampled if greedy.get(r)}

        g, s = figs["greedy"], figs["sampled"]
        out["sampled/greedy"] = {"throughput": over(s["throughput"], g["throughput"]),
                                 "decode": {b: over(s["decode"][b], g["decode"].get(b, {})) for b in s["decode"]}}
    return out


def strata_phases(result: dict, sizes: Sizes, modes: list[str]) -> dict:
    """Share of each step phase in Strata's step time over each decode point's decode window."""
    out = {}
    for mode in modes:
        for batch in sizes.decode_batches:
            if not (run := _run(result, mode, f"decode-b{batch}", "strata")):
                continue
            phases = dict(run["decode_phases_s"])
            wall = phases.pop("wall")
            if wall > 0:
                out.setdefault(mode, {})[str(batch)] = {"step_wall_s": wall, "steps": run["decode_steps"],
                                                        **{p: phases[p] / wall for p in PHASES if p in phases}}
    return out


def targets(shapes: dict) -> list[dict]:
    """Issue 16's targets, met or not, where this run measured them."""
    checks = []

    def check(what: str, value: float | None, target: float, above: bool = True) -> None:
        if value is not None:
            checks.append({"what": what, "value": value, "target": target,
                           "met": value >= target if above else value <= target})

    for key, res in shapes.items():
        for mode in ("greedy", "sampled"):
            r = res["ratios"].get(mode)
            if not r:
                continue
            if key in ("M", "L"):
                check(f"{key} {mode} throughput strata/vllm", r["throughput"].get("strata/vllm"), TARGET_VS_VLLM)
            for label, value in [("throughput", r["throughput"].get("strata/hf-static"))] + [
                    (f"decode b{b}", v.get("strata/hf-static")) for b, v in r["decode"].items()]:
                check(f"{key} {mode} {label} strata/hf-static", value, TARGET_VS_HF_STATIC)
        sg = res["ratios"].get("sampled/greedy", {})
        if key in ("M", "L") and "32" in sg.get("decode", {}):
            check(f"{key} decode b32 strata sampled/greedy", sg["decode"]["32"].get("strata"),
                  TARGET_SAMPLED_OVER_GREEDY)
        if key == "L":
            share = res["strata_decode_phases"].get("sampled", {}).get("64", {}).get("sample")
            check("L sampled decode b64 strata sampling share of step time", share, TARGET_SAMPLE_SHARE, above=False)
    return checks


# ---------------------------------------------------------------- printing and plotting


def print_shape(key: str, res: dict) -> None:
    runners = list(res["runners"])
    print(f"\n-- {key}: tokens/s (load s: " +
          ", ".join(f"{r} {res['runners'][r]['load_s']:.1f}" for r in runners) + ")")
    others = [o for o in ("vllm", "hf-static", "hf-cb") if o in runners and "strata" in runners]
    print(f"  {'':7s} {'':14s}" + "".join(f"{r:>11s}" for r in runners)
          + "".join(f"{'strata/' + o:>18s}" for o in others))
    for mode, fig in res["figures"].items():
        rows = [("throughput", fig["throughput"], res["ratios"][mode]["throughput"])]
        rows += [(f"prefill {k}", v, res["ratios"][mode]["prefill"][k]) for k, v in fig["prefill"].items()]
        rows += [(f"decode b{k}", v, res["ratios"][mode]["decode"][k]) for k, v in fig["decode"].items()]
        for label, values, rat in rows:
            print(f"  {mode:7s} {label:14s}" + "".join(f"{values[r]:11.1f}" if r in values else f"{'-':>11s}"
                                                      for r in runners)
                  + "".join(f"{rat[f'strata/{o}']:17.2f}x" if f"strata/{o}" in rat else f"{'-':>18s}" for o in others))
    sg = res["ratios"].get("sampled/greedy")
    if sg:
        print("  sampled/greedy throughput: " + ", ".join(f"{r} {v:.2f}x" for r, v in sg["throughput"].items()))
        if "32" in sg["decode"]:
            print("  sampled/greedy decode b32: " + ", ".join(f"{r} {v:.2f}x" for r, v in sg["decode"]["32"].items()))
    for mode, per_batch in res["strata_decode_phases"].items():
        for batch, split in per_batch.items():
            print(f"  strata {mode} decode b{batch} step split: " + ", ".join(
                f"{p} {split[p] * 100:.0f}%" for p in PHASES if split.get(p, 0) >= 0.005))
    if res["others_cpu"]:
        print(f"  other processes took a median {res['others_cpu']['median']:.0%} (at most "
              f"{res['others_cpu']['max']:.0%}) of the machine's CPU during these runs")
    for mode, fig in res["figures"].items():
        if fig["noisy"]:
            print(f"  {mode}: disturbed by other processes in every attempt (the least disturbed counts): "
                  + ", ".join(fig["noisy"]))
        for what in fig["unreliable"]:
            print(f"  {mode} {what}: under {MIN_DECODE_STEPS}, not counted (raise --decode-tokens)")
    for name, why in res["skipped"].items():
        print(f"  skipped {name}: {why}")
    for name, info in res["runners"].items():
        for note in info["notes"]:
            print(f"  note {name}: {note}")


COLORS = {"strata": "#d62728", "vllm": "#1f77b4", "hf-static": "#7f7f7f", "hf-cb": "#2ca02c"}
PHASE_COLORS = {"forward": "#1f77b4", "sample": "#d62728", "prepare": "#ff7f0e", "schedule": "#9467bd",
                "detokenize": "#2ca02c", "bookkeeping": "#8c564b", "other": "#c7c7c7"}


def plot(shapes: dict, path: Path, where: str) -> None:
    """`where`: the machine, as the title says it ("on the CPU, 2 threads each, float32")."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(shapes), 4, figsize=(20, 4.2 * len(shapes)), squeeze=False)
    for row, (key, res) in enumerate(shapes.items()):
        runners = list(res["runners"])
        modes = list(res["figures"])
        title = f"{key}: {res['params'] / 1e6:.0f}M params, vocab {res['shape']['vocab_size']:,}"
        ax = axes[row][0]
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            values = [res["figures"][mode]["throughput"].get(r, 0) for r in runners]
            bars = ax.bar([x + i * width for x in range(len(runners))], values, width,
                          color=[COLORS[r] for r in runners], alpha=1.0 if mode == "greedy" else 0.55,
                          hatch=None if mode == "greedy" else "//", label=mode)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(runners))], runners)
        ax.set_ylabel("output tokens/s")
        vs = ", ".join(f"{m} {res['ratios'][m]['throughput'][k]:.2f}x" for m in modes
                       for k in ("strata/vllm",) if k in res["ratios"][m]["throughput"])
        ax.set_title(f"{title}: throughput, {res['sizes']['requests']} mixed requests\n"
                     f"(solid greedy, hatched sampled){'; strata/vllm ' + vs if vs else ''}", fontsize=9)
        for col, metric, xlabel in ((1, "prefill", "prompt tokens"), (2, "decode", "batch (requests decoding)")):
            ax = axes[row][col]
            for mode in modes:
                data = res["figures"][mode][metric]
                for r in runners:
                    xs = [int(k) for k in data if r in data[k]]
                    if xs:
                        ax.plot(xs, [data[str(x)][r] for x in xs], marker="o", color=COLORS[r],
                                linestyle="-" if mode == "greedy" else "--", label=f"{r} {mode}")
            ax.set_xscale("log", base=2)
            ticks = sorted({int(k) for mode in modes for k in res["figures"][mode][metric]})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{metric} tokens/s")
            ax.set_title(f"{key} {metric} (solid greedy, dashed sampled)", fontsize=9)
            ax.grid(alpha=0.3)
            if row == 0 and col == 2:
                ax.legend(fontsize=7, ncol=2)
        ax = axes[row][3]
        split = res["strata_decode_phases"].get("sampled") or res["strata_decode_phases"].get("greedy") or {}
        batches = [f"b{b}" for b in split]
        split = {f"b{b}": v for b, v in split.items()}
        bottom = [0.0] * len(batches)
        for phase in PHASES:
            shares = [split[b].get(phase, 0) * 100 for b in batches]
            ax.bar(batches, shares, bottom=bottom, color=PHASE_COLORS[phase], label=phase)
            bottom = [a + b for a, b in zip(bottom, shares)]
        ax.axhline(TARGET_SAMPLE_SHARE * 100, color="black", linewidth=0.8, linestyle=":")
        ax.set_ylim(0, 100)
        ax.set_xlabel("decode batch")
        ax.set_ylabel("% of Strata's step time")
        which = "sampled" if "sampled" in res["strata_decode_phases"] else "greedy"
        ax.set_title(f"{key} Strata decode step split ({which}; "
                     f"dotted: sampling target {TARGET_SAMPLE_SHARE:.0%})", fontsize=9)
        if row == 0:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"Strata vs vLLM (CPU) vs Hugging Face {where}, same prompts", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------- main


def parse_pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def parse_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(","))
    if not values or min(values) < 1 or len(set(values)) < len(values):  # a point is named by its value
        raise argparse.ArgumentTypeError(f"expected distinct positive integers, got {text!r}")
    return values


def parse_list(choices):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing'}: choose from {', '.join(choices)}")
        return values
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_list(tuple(SHAPES)), default=list(SHAPES), help="S,M,L")
    parser.add_argument("--runners", type=parse_list(RUNNERS), default=list(RUNNERS), help=",".join(RUNNERS))
    parser.add_argument("--modes", type=parse_list(tuple(MODES)), default=list(MODES), help="greedy,sampled")
    parser.add_argument("--quick", action="store_true", help="small workloads: a few minutes for S,M")
    parser.add_argument("--threads", type=int, default=2, help="threads for every runner")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N for the Strata and Hugging Face runners (vLLM's CPU build: cpu only)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="every runner's dtype (auto: bf16, what the M and L checkpoints hold and what vLLM's "
                             "CPU build runs by default, where the CPU has bf16 instructions; else fp32, as "
                             "Strata's dtype=auto: there bf16 matmuls are emulated, several times slower)")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache for every runner (GiB)")
    parser.add_argument("--strata-sampler-backend", default="auto", choices=("auto", "torch", "triton"),
                        help="Strata's sampler_backend engine argument (torch: its sampler in torch ops, an A/B)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, help="throughput requests (default: per shape)")
    parser.add_argument("--prompt-len", type=parse_pair, help="MIN,MAX prompt tokens of the throughput workload")
    parser.add_argument("--output-len", type=parse_pair, help="MIN,MAX output tokens of the throughput workload")
    parser.add_argument("--prefill-lens", type=parse_ints, help="prompt lengths of the prefill points")
    parser.add_argument("--prefill-tokens", type=int, help="prompt tokens per prefill point")
    parser.add_argument("--decode-batches", type=parse_ints, help="batch sizes of the decode points")
    parser.add_argument("--decode-prompt-len", type=int)
    parser.add_argument("--decode-tokens", type=int, help="output tokens per decode request")
    parser.add_argument("--repeats", type=int, help="runs of each point, the median counts (default: per shape)")
    parser.add_argument("--max-others-cpu", type=float, default=0.2,
                        help="a run during which other processes took more of the CPU is redone")
    parser.add_argument("--max-retries", type=int, default=2, help="disturbed runs redone per point, at most")
    parser.add_argument("--quiet-wait", type=float, default=20,
                        help="seconds to wait, at most, before each run for other processes to leave the CPU")
    parser.add_argument("--noise-budget", type=float, default=900,
                        help="seconds the whole bench may spend waiting for quiet and redoing disturbed runs")
    parser.add_argument("--interleave", choices=("auto", "yes", "no"), default="auto",
                        help="all runners loaded at once, taking turns at every point (auto: when memory allows)")
    parser.add_argument("--vllm-venv", default=os.environ.get("STRATA_VLLM_VENV", DEFAULT_VLLM_VENV),
                        help=f"vLLM's venv (env STRATA_VLLM_VENV; default {DEFAULT_VLLM_VENV})")
    parser.add_argument("--vllm-cpu-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND (default: 0-<threads-1>)")
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--load-timeout", type=float, default=1800, help="seconds a runner may take to load")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--seed", type=int, default=0, help="prompts and lengths")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_realistic.json"))
    parser.add_argument("--png", help="default: --out's path with .png")
    args = parser.parse_args()
    args.png = args.png or str(Path(args.out).with_suffix(".png"))
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1):
        parser.error("--threads and --repeats must be >= 1")
    if args.dtype == "auto":
        from services.engine.model_runner import cpu_has_native_bf16

        args.dtype = "bfloat16" if args.device != "cpu" or cpu_has_native_bf16() else "float32"

    skipped = {}
    if "vllm" in args.runners and args.device != "cpu":
        skipped["vllm"] = f"vLLM's CPU build does not run on {args.device}"
        print(f"skipping the vllm runner: {skipped['vllm']}")
    elif "vllm" in args.runners:
        python, why = vllm_python(args.vllm_venv)
        if python is None:
            print(f"skipping the vllm runner: {why}")
            skipped["vllm"] = why
    runners = [r for r in args.runners if r not in skipped]
    overrides = {k: v for k, v in {
        "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "prefill_lens": args.prefill_lens, "prefill_tokens": args.prefill_tokens,
        "decode_batches": args.decode_batches, "decode_prompt_len": args.decode_prompt_len,
        "decode_tokens": args.decode_tokens, "repeats": args.repeats}.items() if v is not None}
    log_dir = Path(tempfile.mkdtemp(prefix="engine_realistic_"))
    print(f"runners {', '.join(runners)} on {args.device}; {args.threads} threads each; {args.dtype}; "
          f"runner logs in {log_dir}",
          flush=True)

    started = time.perf_counter()
    guard = NoiseGuard(args)
    shapes: dict[str, dict] = {}
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "device": args.device, **cpu_model(), **gpu_model(args.device)}
    for key in args.shapes:
        shape_start = time.perf_counter()
        sizes = dataclasses.replace((QUICK if args.quick else FULL)[key], **overrides)
        shapes[key] = run_shape(key, sizes, runners, skipped, guard, args, log_dir)
        shapes[key]["wall_s"] = time.perf_counter() - shape_start
        print_shape(key, shapes[key])
        write_results(args.out, args, {"machine": machine, "wall_s": time.perf_counter() - started,
                                       "shapes": shapes, "targets": targets(shapes)})

    checks = targets(shapes)
    if checks:
        print("\ntargets (issue 16):")
        for c in checks:
            print(f"  {'met    ' if c['met'] else 'NOT met'} {c['what']}: {c['value']:.2f} "
                  f"({'>=' if 'share' not in c['what'] else '<='} {c['target']})")
    wall = time.perf_counter() - started
    print(f"\nwall time {wall / 60:.1f} min, of which {guard.spent / 60:.1f} min waiting for other processes "
          f"to leave the CPU and redoing runs they disturbed")
    write_results(args.out, args, {"machine": machine, "wall_s": wall, "noise_spent_s": guard.spent,
                                   "shapes": shapes, "targets": checks})
    if shapes:
        where = (f"on the CPU, {args.threads} threads each" if args.device == "cpu"
                 else f"on {machine.get('gpu', args.device)}")
        plot(shapes, Path(args.png), f"{where}, {args.dtype}")
    failed = any(set(res["skipped"]) - set(skipped) or any(
        "error" in run for runs in res["runs"].values() for per_runner in runs.values() for run in per_runner.values())
        for res in shapes.values())
    if failed:
        print(f"runner logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
