"""How bench/engine_realistic.py talks to its runner processes; the standard library only, because the
vLLM runner imports it from vLLM's own venv.

A runner process is started as `PYTHON RUNNER_SCRIPT RUNNER_NAME JOB.json`. The job holds the model
directory, the thread count, engine sizes, the sampling modes ({"greedy": {"temperature": 0.0},
"sampled": {"temperature": ..., "top_p": ..., "top_k": ..., "repetition_penalty": ..., "seed": BASE}}:
request i of a workload gets seed BASE + i where the runner supports per-request seeds) and every
workload ({"name", "prompts": [[token ids]], "max_tokens": [one per prompt]}; every request ignores EOS). The process
loads the model (timed: `load_s`), answers one `ready` line, then takes commands on stdin, one JSON
object a line, and answers each with one JSON line:

    {"op": "run", "workload": "throughput", "mode": "greedy"}
        -> {"seconds": 12.3, "output_tokens": 4096, "prompt_tokens": 9000, ...}  or  {"error": "..."}
    {"op": "quit"}

Every runner is timed here, the same way: the first run of a mode is preceded by the runner's warm-up
(timed apart, `warmup_s`); only the call that generates is inside `seconds` (building the requests and
counting the outputs are outside). A decode workload (one with "decode_batch": B) is also timed step
by step: the runner records when each engine step ended and how many tokens it gave (a `StepClock`),
and its answer adds `decode_s`, `decode_tokens` and `decode_steps`, the window of steps in which all
B requests were decoding (after the step that gave the last of them its first token, up to the last
step that gave every one of them a token). The prefill is outside that window, whatever its length,
so a decode rate needs no second run to subtract. The answers go to the original stdout; everything
else the process prints (vLLM logs to stdout) is sent to stderr, so it cannot corrupt the protocol.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Protocol

class Runner(Protocol):
    notes: list[str]  # what this runner does differently (unsupported parameters, seeding), reported

    def warmup(self, mode: str) -> None: ...

    def prepare(self, workload: dict, mode: str) -> tuple[Callable[[], Any], Callable[[Any], dict]]:
        """(generate, account): `generate()` is timed; `account(its result)` returns at least
        output_tokens and prompt_tokens, untimed."""
        ...


class StepClock:
    """The end time and token count of each engine step of one run, for its decode window."""

    def __init__(self, batch: int):
        self.batch = batch
        self.steps: list[tuple[float, int]] = []

    def record(self, tokens: int) -> None:
        self.steps.append((time.perf_counter(), tokens))

    def record_requests(self, token_times: list[list[float]]) -> None:
        """Steps from each request's own token timestamps (a runner that stamps tokens, not steps): a
        step's tokens are stamped microseconds apart, its neighbours a step time away, so a gap of
        over a quarter of a request's median gap between tokens starts a new step."""
        gaps = [b - a for times in token_times for a, b in zip(times, times[1:])]
        split = statistics.median(gaps) / 4 if gaps else 0.0
        for stamp in sorted(t for times in token_times for t in times):
            if self.steps and stamp - self.steps[-1][0] <= split:
                self.steps[-1] = (stamp, self.steps[-1][1] + 1)
            else:
                self.steps.append((stamp, 1))

    def window(self) -> tuple[int, int]:
        """Indices (first, last) of the steps bounding the decode window: it runs from the end of
        `first`, the first step that gave every request a token (so the last one's first token),
        to the end of `last`, the last such step. The steps in it all decode the whole batch."""
        full = [i for i, (_, tokens) in enumerate(self.steps) if tokens == self.batch]
        if len(full) < 2:  # the first requests ended before the last began, or max_tokens is 1
            raise RuntimeError(f"no decode window: {len(full)} of {len(self.steps)} steps gave all {self.batch} "
                               f"requests a token; give them more output tokens than the prefill takes steps")
        return full[0], full[-1]

    def figures(self) -> dict:
        first, last = self.window()
        return {"decode_s": self.steps[last][0] - self.steps[first][0],
                "decode_tokens": sum(tokens for _, tokens in self.steps[first + 1:last + 1]),
                "decode_steps": last - first}


def thread_env(threads: int) -> dict[str, str]:
    """Environment for a runner process: the thread count for OpenMP/MKL, offline Hugging Face."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def serve(make_runner: Callable[[str, dict], Runner]) -> None:
    name, job_path = sys.argv[1], sys.argv[2]
    job = json.loads(open(job_path).read())
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    try:
        start = time.perf_counter()
        runner = make_runner(name, job)
        answer({"ready": True, "load_s": time.perf_counter() - start, "notes": runner.notes})
    except Exception as exc:  # the model did not load: say why, then exit
        traceback.print_exc()
        answer({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    workloads = {w["name"]: w for w in job["workloads"]}
    warmed: dict[str, float] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            mode = cmd["mode"]
            if mode not in warmed:
                start = time.perf_counter()
                runner.warmup(mode)
                warmed[mode] = time.perf_counter() - start
            generate, account = runner.prepare(workloads[cmd["workload"]], mode)
            start = time.perf_counter()
            result = generate()
            seconds = time.perf_counter() - start
            answer({"seconds": seconds, "warmup_s": warmed[mode], **account(result)})
        except Exception as exc:
            traceback.print_exc()
            answer({"error": f"{type(exc).__name__}: {exc}"})
