"""Overload: the local stack under open-loop load at 2x and 5x its capacity.

The capacity: closed-loop clients, as many as the gateway admits at once (more than the engines
batch), for `--capacity-s` seconds; completions per second is the stack's capacity (1x). Then
open-loop Poisson arrivals at 2x and at 5x the first capacity for `--seconds` each: arrivals do
not wait for answers, as real traffic does not. The capacity is measured again after each
overload phase, and each phase is compared with the mean of the capacities measured just before
and just after it (these machines are shared: what the stack gets of the CPU drifts). Every
request carries a deadline (`Strata-Timeout`). Per overload phase:

- answered within its deadline: a response (success, or a refusal: 429/503 with Retry-After)
  that reached the client by its deadline (plus 0.5 s for the HTTP path); the rest count as late
  or lost. Must be every request.
- goodput: successful completions per second that arrived within their deadline, counted by
  when they completed, in the phase's steady part (after its first `--settle` seconds, as the
  queues fill), against the capacity measured the same way at 1x beside it. Must be at least 80%.
  (Counted by when they were sent, a phase would also be credited with the requests it admitted
  into empty queues at its start.)
- false "replica dead" verdicts: replicas the gateway presumed dead or stalled, streams it moved
  (migrations) and requests it failed for a silent scheduler. No replica dies here, so every one
  would be false. Must be 0.

Prints the figures, writes bench/results/overload.json and overload.png; exits 1 if a check
fails.

    python bench/overload.py [--engines 2] [--seconds 60] [--deadline 10] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from bench.common import percentile, pyplot, write_results  # noqa: E402
from shared.localstack import LocalStack  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

GRACE_S = 0.5  # the HTTP path after the deadline: answers later than deadline + this are late


@dataclass
class Result:
    sent: float  # seconds since the phase started
    status: int  # HTTP status; 0: no answer (connection error), -1: the client gave up
    latency: float
    tokens: int = 0
    retry_after: str | None = None

    @property
    def done(self) -> float:
        return self.sent + self.latency


@dataclass
class Phase:
    name: str
    rate: float  # arrivals per second (0: closed loop)
    seconds: float
    results: list[Result] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process during the phase
    elapsed: float = 0.0  # wall seconds the phase took, its last answers included

    @property
    def engine_cores(self) -> float:
        """CPU cores the engines got, on average, during the phase."""
        return sum(v for k, v in self.cpu.items() if k.startswith("engine")) / max(self.elapsed, 1e-9)

    def goodput(self, deadline: float, settle: float) -> float:
        """Successes on time per second, by completion, after the phase settled."""
        good = [r for r in self.results if r.status == 200 and r.latency <= deadline + GRACE_S
                and settle <= r.done < self.seconds]
        return len(good) / (self.seconds - settle)

    def summary(self, deadline: float, capacity: float | None, settle: float) -> dict:
        rs = self.results
        on_time = [r for r in rs if r.status > 0 and r.latency <= deadline + GRACE_S]
        good = [r for r in on_time if r.status == 200]
        statuses = Counter(r.status for r in rs)
        refused = [r for r in rs if r.status in (429, 503)]
        out = {
            "name": self.name, "offered_rps": round(self.rate or len(rs) / self.seconds, 2), "seconds": self.seconds,
            "requests": len(rs), "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "answered_within_deadline": len(on_time), "answered_within_deadline_pct": round(
                100 * len(on_time) / max(len(rs), 1), 2),
            "goodput_rps": round(self.goodput(deadline, settle), 2),
            "refusals_with_retry_after_pct": round(100 * sum(r.retry_after is not None for r in refused)
                                                   / max(len(refused), 1), 2),
            "latency_s": {"p50_ok": round(percentile([r.latency for r in good], 0.5), 3),
                          "p99_ok": round(percentile([r.latency for r in good], 0.99), 3),
                          "p50_refused": round(percentile([r.latency for r in refused], 0.5), 4),
                          "p99_refused": round(percentile([r.latency for r in refused], 0.99), 4),
                          "max": round(max((r.latency for r in rs), default=0.0), 3)},
        }
        if capacity:
            out["goodput_vs_capacity"] = round(self.goodput(deadline, settle) / capacity, 3)
        out["cpu_cores"] = {k: round(v / max(self.elapsed, 1e-9), 2)
                            for k, v in sorted(self.cpu.items(), key=lambda kv: -kv[1])}
        return out


class LoadGenerator:
    def __init__(self, stack: LocalStack, deadline: float, max_tokens: int, seed: int):
        self.stack, self.deadline, self.max_tokens = stack, deadline, max_tokens
        self.rng = random.Random(seed)

    def body(self) -> dict:
        rng = self.rng
        prompt = [rng.randrange(8, 4000) for _ in range(rng.randrange(8, 48))]
        return {"model": self.stack.deployment, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True}

    async def one(self, http: aiohttp.ClientSession, phase: Phase, started: float) -> None:
        sent = time.monotonic()
        headers = {"Authorization": f"Bearer {self.stack.api_key}", "Strata-Timeout": str(self.deadline)}
        try:
            async with http.post(self.stack.base_url + "/v1/completions", json=self.body(), headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=self.deadline + 10)) as resp:
                data = await resp.json(content_type=None)
                tokens = (data.get("usage") or {}).get("completion_tokens", 0) if resp.status == 200 else 0
                result = Result(sent - started, resp.status, time.monotonic() - sent, tokens,
                                resp.headers.get("Retry-After"))
        except asyncio.TimeoutError:
            result = Result(sent - started, -1, time.monotonic() - sent)
        except aiohttp.ClientError:
            result = Result(sent - started, 0, time.monotonic() - sent)
        phase.results.append(result)

    async def closed_loop(self, http, phase: Phase, clients: int) -> None:
        started = time.monotonic()
        end = started + phase.seconds

        async def client() -> None:
            while time.monotonic() < end:
                await self.one(http, phase, started)
        await asyncio.gather(*(client() for _ in range(clients)))

    async def open_loop(self, http, phase: Phase) -> None:
        """Poisson arrivals at phase.rate, each its own task: none waits for another's answer."""
        started = time.monotonic()
        tasks, at = set(), started
        while True:
            at += self.rng.expovariate(phase.rate)
            if at >= started + phase.seconds:
                break
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self.one(http, phase, started))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=self.deadline + 15)


def gateway_counters(stack: LocalStack) -> dict[str, float]:
    """The gateway's liveness verdicts and refusals so far (Prometheus text)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"/metrics: {exc.code} {exc.read()[:300]!r}") from None
    wanted = {"strata:gateway_replica_dead_verdicts_total": "replica_dead_verdicts",
              "strata:gateway_scheduler_dead_verdicts_total": "scheduler_dead_verdicts",
              "strata:gateway_migrations_total": "migrations",
              "strata:gateway_refused_requests_total": "refused_at_gateway"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return out


def cpu_seconds(stack: LocalStack) -> dict[str, float]:
    """CPU time (user + system) each process of the stack, and this load generator, used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = {name: proc.pid for name, proc in stack.services.items()}
    pids.update({f"{p.name}-{p.port}": p.proc.pid for p in stack.infra.processes})
    pids["load generator"] = os.getpid()
    out = {}
    for name, pid in pids.items():
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return out


def engine_restarts(stack: LocalStack) -> int:
    """Engine processes that exited (none should)."""
    return sum(proc.poll() is not None for name, proc in stack.services.items() if name.startswith("engine"))


def plot(phases: list[Phase], capacity: float, deadline: float, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for phase in phases:
        if not phase.rate:
            continue
        buckets = int(math.ceil(phase.seconds))
        good, refused = [0] * buckets, [0] * buckets
        for r in phase.results:  # successes by when they completed, refusals by when they were asked
            if r.status == 200 and r.latency <= deadline + GRACE_S and r.done < buckets:
                good[int(r.done)] += 1
            elif r.status in (429, 503):
                refused[min(int(r.sent), buckets - 1)] += 1
        ax1.plot(range(buckets), good, label=f"{phase.name}: goodput")
        ax1.plot(range(buckets), refused, linestyle=":", label=f"{phase.name}: refused (503/429)")
        ok = sorted(r.latency for r in phase.results if r.status == 200)
        if ok:
            ax2.plot(ok, [i / len(ok) for i in range(len(ok))], label=f"{phase.name}: served")
        no = sorted(r.latency for r in phase.results if r.status in (429, 503))
        if no:
            ax2.plot(no, [i / len(no) for i in range(len(no))], linestyle=":", label=f"{phase.name}: refused")
    ax1.axhline(capacity, color="grey", linestyle="--", label="capacity (1x, first)")
    ax1.axhline(0.8 * capacity, color="red", linestyle="--", label="80% of it")
    ax1.set(xlabel="second of the phase", ylabel="requests per second", title="Goodput under open-loop overload")
    ax1.legend(fontsize=7)
    ax2.axvline(deadline, color="red", linestyle="--", label="deadline")
    ax2.set(xscale="log", xlabel="seconds to the answer", ylabel="fraction of requests", title="Answer time")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0, help="length of each overload phase")
    p.add_argument("--capacity-s", type=float, default=30.0, help="length of the capacity (1x) measurement")
    p.add_argument("--capacity-clients", type=int, default=256,
                   help="closed-loop clients measuring the capacity (default: the gateway's in-flight limit)")
    p.add_argument("--multiples", default="2,5",
                   help="open-loop phases, as multiples of the capacity (1: how the open-loop harness itself does)")
    p.add_argument("--deadline", type=float, default=10.0, help="every request's Strata-Timeout, seconds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds at the start of each phase not counted in its goodput (queues filling)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    p.add_argument("--scheduler-arg", action="append", default=[], help="extra scheduler flag (repeatable)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "overload.json"))
    args = p.parse_args()

    model = ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    stack = LocalStack(str(model), engines=args.engines, auth=True,
                       engine_args=["--threads", "1", "--num-kv-blocks", "1024"],
                       gateway_args=args.gateway_arg, scheduler_args=args.scheduler_arg)
    stack.start(timeout=180)
    try:
        stack.wait_serving(60)
        settle = min(args.settle, args.capacity_s / 2, args.seconds / 2)
        gen = LoadGenerator(stack, args.deadline, args.max_tokens, args.seed)

        async def run() -> tuple[float, list[Phase], dict]:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10)
            async with aiohttp.ClientSession(connector=connector) as http:
                warm = Phase("warm-up", 0, 5.0)
                await gen.closed_loop(http, warm, args.capacity_clients)

                async def measure(phase: Phase, run_phase) -> Phase:
                    cpu, started = cpu_seconds(stack), time.monotonic()
                    await run_phase
                    phase.elapsed = time.monotonic() - started
                    phase.cpu = {k: v - cpu.get(k, 0.0) for k, v in cpu_seconds(stack).items()}
                    return phase

                def capacity_phase(i: int) -> Phase:
                    return Phase(f"1x capacity #{i} (closed loop)", 0, args.capacity_s)

                base = capacity_phase(0)
                await measure(base, gen.closed_loop(http, base, args.capacity_clients))
                capacity = base.goodput(args.deadline, settle)
                print(f"capacity (1x): {capacity:.1f} completions/s with {args.capacity_clients} clients", flush=True)
                before = await asyncio.to_thread(gateway_counters, stack)
                phases = [base]
                for multiple in (float(m) for m in args.multiples.split(",")):
                    phase = Phase(f"{multiple:g}x", multiple * capacity, args.seconds)
                    await measure(phase, gen.open_loop(http, phase))
                    again = capacity_phase(len(phases) // 2 + 1)
                    await measure(again, gen.closed_loop(http, again, args.capacity_clients))
                    phases += [phase, again]
                    print(f"{phase.name}: {phase.summary(args.deadline, capacity, settle)}; then {again.name}: "
                          f"{again.goodput(args.deadline, settle):.1f}/s", flush=True)
                after = await asyncio.to_thread(gateway_counters, stack)
            return capacity, phases, {k: after[k] - before[k] for k in after}

        capacity, phases, counters = asyncio.run(run())
        restarts = engine_restarts(stack)
    finally:
        stack.stop()

    summaries = []
    for i, phase in enumerate(phases):
        if phase.rate:  # an open-loop phase: against the capacities measured just before and after it
            beside = [round(phases[j].goodput(args.deadline, settle), 2) for j in (i - 1, i + 1)]
            summary = phase.summary(args.deadline, sum(beside) / 2, settle)
            summary["capacity_beside_rps"] = beside
            summary["goodput_vs_first_capacity"] = round(summary["goodput_rps"] / capacity, 3)
            # The same per CPU core its engines got (the machine's other work takes what it takes).
            per_core = [phases[j].goodput(args.deadline, settle) / phases[j].engine_cores for j in (i - 1, i + 1)]
            summary["goodput_per_engine_core_vs_capacity"] = round(
                summary["goodput_rps"] / phase.engine_cores / (sum(per_core) / 2), 3)
        else:
            summary = phase.summary(args.deadline, None, settle)
        summaries.append(summary)
    overload = [s for s in summaries if s.get("capacity_beside_rps") and s["offered_rps"] > 1.5 * capacity]
    false_verdicts = counters["replica_dead_verdicts"] + counters["scheduler_dead_verdicts"] + counters["migrations"]
    checks = {
        "every_request_answered_within_its_deadline": all(s["answered_within_deadline"] == s["requests"]
                                                          for s in overload),
        "goodput_at_least_80pct_of_capacity": all(s["goodput_vs_capacity"] >= 0.8 for s in overload),
        "no_false_dead_verdicts": false_verdicts == 0 and restarts == 0,
    }
    print(f"\ncapacity at 1x: {capacity:.1f} completions/s (max_tokens {args.max_tokens}, deadline {args.deadline:g}s, "
          f"{args.engines} engines)")
    for s in [s for s in summaries if s.get("capacity_beside_rps")]:
        print(f"{s['name']:>4}: offered {s['offered_rps']:.0f}/s, goodput {s['goodput_rps']:.1f}/s = "
              f"{100 * s['goodput_vs_capacity']:.0f}% of the capacity beside it "
              f"({' and '.join(f'{c:.1f}' for c in s['capacity_beside_rps'])}/s; "
              f"{100 * s['goodput_vs_first_capacity']:.0f}% of the first; per engine core "
              f"{100 * s['goodput_per_engine_core_vs_capacity']:.0f}%); answered within deadline "
              f"{s['answered_within_deadline']}/{s['requests']} ({s['answered_within_deadline_pct']}%); statuses "
              f"{s['statuses']}; refusals p99 {1e3 * s['latency_s']['p99_refused']:.0f} ms, served p99 "
              f"{s['latency_s']['p99_ok']:.2f}s")
    print(f"false 'replica dead' verdicts: {false_verdicts:.0f} (replica {counters['replica_dead_verdicts']:.0f}, "
          f"scheduler {counters['scheduler_dead_verdicts']:.0f}, migrations {counters['migrations']:.0f}); "
          f"engines exited: {restarts}")
    print("checks:", checks)
    out = Path(args.out)
    write_results(out, args, {"capacity_rps": round(capacity, 2), "phases": summaries, "gateway": counters,
                              "engines_exited": restarts, "checks": checks})
    plot(phases, capacity, args.deadline, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
