"""Where a benchmark's CPU goes, process by process.

`CpuWindow`: CPU seconds of named processes (and of their main thread apart from the others) over
a window, per generated token, beside what the whole machine was busy with in the same window
(the difference is other people's work on a shared machine: the noise). `PySpy`: py-spy
(`record --native`) on the same processes for a window, speedscope JSON per process plus a
summary of where the samples fell (per thread by category: idle, GIL wait, OpenMP barrier, torch,
NATS, protocol, ...; top functions by self, innermost-Python and inclusive time).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import psutil


def _cpu_s(times) -> float:
    return times.user + times.system


class CpuWindow:
    """CPU seconds per process over one window: `start()`, the work, `stop(tokens)`.

    A process's `main_thread_s` is its first thread's (an asyncio service's event loop: NATS,
    HTTP, protocol work); `other_threads_s` is the rest (an engine's step loop and torch's
    OpenMP pool; executor threads). `machine_busy_s` is every core's non-idle time in the window,
    so `others_s` (busy minus ours) is what processes outside the benchmark took.
    """

    def __init__(self, pids: dict[str, int]):
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}

    def _snapshot(self) -> dict[str, tuple[float, float]]:
        out = {}
        for name, proc in self.procs.items():
            with proc.oneshot():
                main = next((t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid), 0.0)
                out[name] = (_cpu_s(proc.cpu_times()), main)
        return out

    @staticmethod
    def _machine_busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def start(self) -> "CpuWindow":
        self._before, self._busy0, self._t0 = self._snapshot(), self._machine_busy(), time.perf_counter()
        return self

    def stop(self, tokens: int) -> dict:
        after, busy1, wall = self._snapshot(), self._machine_busy(), time.perf_counter() - self._t0
        per_token = 1e3 / max(tokens, 1)
        processes = {}
        for name, (total, main) in after.items():
            total0, main0 = self._before[name]
            cpu, main_s = total - total0, main - main0
            processes[name] = {"cpu_s": round(cpu, 4), "cores": round(cpu / wall, 3),
                               "cpu_ms_per_token": round(cpu * per_token, 4),
                               # max(): the two reads are microseconds apart, and threads that
                               # ended in the window are in the total only
                               "main_thread_s": round(main_s, 4), "other_threads_s": round(max(cpu - main_s, 0.0), 4)}
        ours = sum(p["cpu_s"] for p in processes.values())
        busy = busy1 - self._busy0
        return {"wall_s": round(wall, 4), "tokens": tokens, "processes": processes,
                "total_cpu_s": round(ours, 4), "total_cpu_ms_per_token": round(ours * per_token, 4),
                "machine_busy_s": round(busy, 4), "others_s": round(max(busy - ours, 0.0), 4),
                "machine_cores": psutil.cpu_count()}


def format_cpu(window: dict) -> str:
    """One line per process: CPU ms per token, cores used, the main thread's share."""
    lines = []
    for name, p in sorted(window["processes"].items(), key=lambda kv: -kv[1]["cpu_s"]):
        lines.append(f"    {name:<10} {p['cpu_ms_per_token']:7.3f} ms/token  {p['cores']:5.2f} cores  "
                     f"(main thread {p['main_thread_s']:6.2f} s, other threads {p['other_threads_s']:6.2f} s)")
    lines.append(f"    {'total':<10} {window['total_cpu_ms_per_token']:7.3f} ms/token  "
                 f"{window['total_cpu_s'] / window['wall_s']:5.2f} cores of {window['machine_cores']}; "
                 f"outside the bench (noise): {window['others_s'] / window['wall_s']:.2f} cores")
    return "\n".join(lines)


def pyspy_binary() -> str | None:
    search = os.pathsep.join([sysconfig.get_path("scripts"), str(Path(sys.executable).parent),
                              os.environ.get("PATH", "")])
    return shutil.which("py-spy", path=search)


class PySpy:
    """`py-spy record --native` on each Python process for one window (SIGINT ends a recording and
    py-spy writes its file). py-spy pauses a process at each sample (native stacks need it), so a
    profiled window is slower than an unprofiled one: measure figures outside it."""

    def __init__(self, out_dir: Path, rate: int = 200, idle: bool = False):
        binary = pyspy_binary()
        if binary is None:
            raise SystemExit("--profile needs py-spy, which is not installed: "
                             "pip install py-spy==0.4.3 (or pip install -e '.[profile]')")
        self.binary, self.out_dir, self.rate, self.idle = binary, Path(out_dir), rate, idle
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._running: dict[str, tuple[subprocess.Popen, Path, Path]] = {}

    def start(self, tag: str, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            path = self.out_dir / f"{tag}-{name}.speedscope.json"
            log = self.out_dir / f"{tag}-{name}.pyspy.log"
            cmd = [self.binary, "record", "--pid", str(pid), "--native", "--rate", str(self.rate),
                   "--format", "speedscope", "--output", str(path), "--nolineno", *(["--idle"] if self.idle else [])]
            with open(log, "wb") as out:
                self._running[name] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), path, log)
        time.sleep(1.0)  # py-spy attaches and starts sampling
        for name, (proc, _, log) in self._running.items():
            if proc.poll() is not None:
                raise RuntimeError(f"py-spy on {name} exited at once: {log.read_text(errors='replace')[-500:]}")

    def stop(self, top: int = 15) -> dict[str, dict]:
        """End the recordings; a summary per process (and the speedscope file's path)."""
        for proc, _, _ in self._running.values():
            proc.send_signal(signal.SIGINT)
        summaries = {}
        for name, (proc, path, log) in self._running.items():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if not path.exists():
                summaries[name] = {"error": log.read_text(errors="replace")[-500:]}
                continue
            summaries[name] = {"file": str(path), **summarize_speedscope(path, top)}
        self._running.clear()
        return summaries


def _frame_label(frame: dict) -> str:
    file = frame.get("file") or ""
    for marker in ("site-packages/", "/lib/python3", "/work/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{frame['name']} ({file})" if file else frame["name"]


# What a sample was doing, by its stack: waits first (the leaf), then the innermost Python
# frame's file (path fragment -> category); anything else is named by that frame.
_WAIT_LEAVES = {"epoll_wait": "idle: epoll", "epoll_pwait": "idle: epoll"}
_CATEGORIES = (("torch/", "torch ops"), ("kernels/cpu", "Strata C kernels"), ("services/engine/model", "model (Python)"),
               ("services/engine/attention", "model (Python)"), ("services/engine/linear", "model (Python)"),
               ("nats/", "NATS client"), ("msgpack", "protocol encode/decode"),
               ("shared/protocol", "protocol encode/decode"), ("aiohttp/", "aiohttp"), ("/json/", "json"),
               ("prometheus_client", "metrics"), ("opentelemetry", "tracing"), ("structlog", "logging"),
               ("/asyncio/", "asyncio"), ("uvloop", "asyncio"), ("redis/", "Redis client"))


def _category(names: list[str], files: list[str]) -> str:
    if names[-1] in _WAIT_LEAVES:
        return _WAIT_LEAVES[names[-1]]
    # CPython 3.11's GIL: take_gil waits in pthread_cond_timedwait, a forced switch's drop_gil in
    # pthread_cond_wait (libgomp sleeps on a futex, Python locks on semaphores).
    if "pthread_cond_timedwait" in names or "pthread_cond_wait" in names:
        return "wait: GIL"
    if any("libgomp" in f for f in files[-3:]):
        return "OpenMP barrier (spinning)"
    inner = next((i for i in range(len(files) - 1, -1, -1) if files[i].endswith(".py")), None)
    if inner is None:
        return f"native: {names[-1]}"
    return next((label for key, label in _CATEGORIES if key in files[inner]),
                f"{names[inner]} ({'/'.join(files[inner].split('/')[-2:])})")


def summarize_speedscope(path: Path, top: int = 15) -> dict:
    """Sampled seconds (py-spy weighs each sample by its interval), the share per thread, each
    thread's samples by category (waiting, OpenMP spinning, torch, NATS, protocol, ...), and the
    top functions by self time (the leaf), by innermost Python function (a native leaf counted in
    the Python code that called it: libgomp's barrier in the layer that ran the matmul) and by
    inclusive time (anywhere on the stack), as shares of all sampled time."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]
    labels = [_frame_label(f) for f in frames]
    is_python = [(f.get("file") or "").endswith(".py") for f in frames]
    self_counts: Counter = Counter()
    python_counts: Counter = Counter()  # by the innermost Python frame: native leaves folded into their caller
    incl_counts: Counter = Counter()
    threads, categories = {}, {}
    total = 0
    for profile in doc["profiles"]:
        n, cats = 0, Counter()
        for stack, weight in zip(profile["samples"], profile.get("weights") or [1] * len(profile["samples"])):
            n += weight
            if stack:
                cats[_category([frames[i]["name"] for i in stack], [frames[i].get("file") or "" for i in stack])] += weight
                self_counts[labels[stack[-1]]] += weight
                python_counts[labels[next((i for i in reversed(stack) if is_python[i]), stack[-1])]] += weight
            for label in {labels[i] for i in stack}:
                incl_counts[label] += weight
        name = profile.get("name", "?")
        threads[name], categories[name] = n, cats
        total += n
    share = (lambda c: round(c / total, 4)) if total else (lambda c: 0.0)
    return {"sampled_s": round(total, 3),
            "threads": {k: share(v) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
            # per thread, shares of that thread's own samples
            "thread_categories": {k: {c: round(v / threads[k], 4) for c, v in categories[k].most_common(top)}
                                  for k in sorted(threads, key=lambda k: -threads[k]) if threads[k]},
            "top_self": [[label, share(c)] for label, c in self_counts.most_common(top)],
            "top_python": [[label, share(c)] for label, c in python_counts.most_common(top)],
            "top_inclusive": [[label, share(c)] for label, c in incl_counts.most_common(top)]}


def format_profile(name: str, summary: dict, top: int = 8) -> str:
    if "error" in summary:
        return f"    {name}: py-spy failed: {summary['error']}"
    lines = [f"    {name}: {summary['sampled_s']:.1f} s sampled ({summary['file']})",
             "      threads: " + ", ".join(f"{t} {s:.0%}" for t, s in list(summary["threads"].items())[:4])]
    for thread, cats in list(summary["thread_categories"].items())[:3]:
        lines.append(f"      {thread}: " + ", ".join(f"{c} {s:.0%}" for c, s in list(cats.items())[:top]))
    lines += [f"      in Python {s:6.1%}  {label}" for label, s in summary["top_python"][:top]]
    return "\n".join(lines)
