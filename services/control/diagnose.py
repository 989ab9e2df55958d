"""`strata diagnose`: which layer owns the current latency. Pure analysis: figures in, report out.

The figures are what the services' metrics say about one window (services.control.figures
gathers them): per deployment the gateway's layer timings, the scheduler's admission queue and
prefix figures, and per replica the engine's load, token latency, prefix cache and step phases.
Each rule below looks for one kind of trouble and, when it finds it, names the layer that owns
it with the evidence and the usual fix. The report lays out what runs at each of the three
layers and its state; its verdict is the finding that explains the most (a bad revision first:
a deploy gone wrong explains whatever else looks off).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shared.layers import COMPONENT, LAYER_NAMES

LAYERS = ("runtime", "infrastructure", "tooling")


@dataclass
class Thresholds:
    min_requests: int = 5  # fewer requests in the window: too little to judge
    admission_share: float = 0.5  # of TTFT spent in the admission queue
    engine_queue_share: float = 0.5  # of TTFT spent queued inside the engines
    itl_slo_s: float = 0.05  # inter-token latency above this is slow
    low_concurrency: float = 0.5  # requests per replica below this fraction of max_num_seqs
    reachable_min: float = 0.2  # prefix fraction worth routing for
    hit_gap: float = 0.5  # hit rate below this fraction of the reachable rate: routing misses
    cold_start_margin_s: float = 5.0  # a replica whose metrics cover less of the window than this started in it
    cold_start_share: float = 0.5  # of the admission wait spent before a replica was ready: a cold start
    error_ratio: float = 3.0  # a revision with this many times another's error rate
    error_rate_min: float = 0.05
    latency_ratio: float = 2.0  # a revision this many times slower than another


@dataclass
class EngineFigures:
    replica_id: str
    deployment: str
    revision: str = ""
    state: str = "ready"
    window_s: float = 0.0
    running: float = 0.0  # now
    waiting: float = 0.0  # now
    max_num_seqs: int = 64
    kv_usage: float = 0.0  # now
    requests: float = 0.0  # finished in the window
    errors: float = 0.0
    busy_s: float = 0.0  # engine time of those requests, summed (Little's law: / window = concurrency)
    itl_sum: float = 0.0
    itl_count: float = 0.0
    prefix_queries: float = 0.0  # prompt tokens looked up
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    cold_start_wait_s: float = 0.0  # admission wait of requests queued before this replica was ready, summed
    steps: float = 0.0
    step_phases: dict[str, float] = field(default_factory=dict)  # seconds per phase in the window

    @property
    def concurrency(self) -> float:
        return self.busy_s / self.window_s if self.window_s > 0 else 0.0


@dataclass
class DeploymentFigures:
    name: str
    requests: float = 0.0  # completed at the gateway in the window
    ttft_sum: float = 0.0
    e2e_sum: float = 0.0
    layers: dict[str, float] = field(default_factory=dict)  # seconds per layer (shared.layers), summed
    policy: str = ""
    queued: float = 0.0  # requests that waited in an admission queue
    queue_wait_sum: float = 0.0
    queue_depth: float = 0.0  # now
    matched_sum: float = 0.0  # prefix fraction cached on the chosen replica, summed over lookups
    reachable_sum: float = 0.0  # prefix fraction cached on the best replica, summed over lookups
    lookups: float = 0.0
    settings: dict[str, str] = field(default_factory=dict)  # the deployment's stored settings
    replicas: list[EngineFigures] = field(default_factory=list)
    window_s: float = 0.0  # the window the figures cover (a replica covering less started in it)
    events: list[dict] = field(default_factory=list)  # its history's changes in the window, oldest first
    now: float = 0.0  # unix seconds, when the figures were read


@dataclass
class ServiceFigures:
    kind: str  # gateway | scheduler | control | scaler
    instance: str
    url: str
    up: bool
    detail: str = ""


@dataclass
class Figures:
    window_s: float
    deployments: list[DeploymentFigures] = field(default_factory=list)
    services: list[ServiceFigures] = field(default_factory=list)


@dataclass
class Finding:
    layer: str  # runtime | infrastructure | tooling
    area: str  # admission, routing, engine, capacity, revision
    deployment: str
    summary: str
    evidence: list[str]
    fix: str
    weight: float  # how much of the trouble it explains (share of latency or traffic)


@dataclass
class Report:
    window_s: float
    state: dict[str, list[str]]  # layer -> what runs there and its state, one line each
    findings: list[Finding]  # most explaining first
    split: dict[str, dict[str, float]]  # deployment -> component -> share of end-to-end time

    @property
    def verdict(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_dict(self) -> dict:
        return {"window_s": self.window_s, "state": self.state, "split": self.split,
                "verdict": asdict(self.verdict) if self.verdict else None,
                "findings": [asdict(f) for f in self.findings]}


# ---- helpers -----------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.1f} ms"


def _ready(d: DeploymentFigures) -> list[EngineFigures]:
    return [r for r in d.replicas if r.state == "ready"]


def _hit_rate(d: DeploymentFigures) -> float | None:
    queries = sum(r.prefix_queries for r in d.replicas)
    return sum(r.prefix_hits for r in d.replicas) / queries if queries else None


def _itl(d: DeploymentFigures) -> tuple[float, float]:
    count = sum(r.itl_count for r in d.replicas)
    return (sum(r.itl_sum for r in d.replicas) / count if count else 0.0), count


def _step_summary(replicas: list[EngineFigures]) -> tuple[str, str, float]:
    """("step 105 ms: other 95%, forward 3%", top phase, its share) over these replicas."""
    phases: dict[str, float] = {}
    for r in replicas:
        for k, v in r.step_phases.items():
            phases[k] = phases.get(k, 0.0) + v
    steps = sum(r.steps for r in replicas)
    total = sum(phases.values())
    if not steps or total <= 0:
        return "", "", 0.0
    ranked = sorted(phases.items(), key=lambda kv: -kv[1])
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in ranked[:3])
    return f"step {_ms(total / steps)}: {shares}", ranked[0][0], ranked[0][1] / total


STEP_FIXES = {
    "forward": "the model forward dominates: check the device, dtype and attention backend (kernels)",
    "other": "time outside every named phase dominates (Python between phases, launch overhead, GIL): "
             "profile the engine loop; on a GPU, CUDA graphs",
    "schedule": "host-side batch scheduling dominates: profile the engine scheduler",
    "prepare": "host-side input preparation dominates: profile tensor building",
    "bookkeeping": "host-side bookkeeping dominates: profile prefix-cache registration and stop checks",
    "sample": "sampling dominates: check logprobs and penalties in the requests",
    "detokenize": "detokenization dominates: check stop strings in the requests",
}


# ---- rules -------------------------------------------------------------------------------------
def _started_in_window(d: DeploymentFigures, t: Thresholds) -> list[EngineFigures]:
    """Replicas that started during the window: their metrics cover less of it."""
    return [r for r in d.replicas if r.state != "unreachable" and d.window_s > 0
            and r.window_s < d.window_s - t.cold_start_margin_s]


def _cold_start(d: DeploymentFigures, t: Thresholds, share: float) -> Finding | None:
    """Most of the admission wait was requests queued before a replica was ready (each engine
    counts those), and no replica up all along was busy: the requests waited for a replica to
    exist (scale from zero, a new deployment), not for room on a full one."""
    waited = d.layers.get("admission_wait", 0.0)
    cold = sum(r.cold_start_wait_s for r in d.replicas)
    young = [r for r in _started_in_window(d, t) if r.cold_start_wait_s > 0] or _started_in_window(d, t)
    old = [r for r in _ready(d) if r not in young]
    busy = [r for r in old if r.concurrency >= t.low_concurrency * r.max_num_seqs]
    if waited <= 0 or cold < t.cold_start_share * waited or busy:
        return None
    starts = ", ".join(f"{r.replica_id} {max(d.window_s - r.window_s, 0):.0f} s into the window" for r in young)
    summary = (f"{share:.0%} of TTFT is admission wait while replicas started: a cold start, not saturation"
               + ("" if old else " (no replica was up when the window began)"))
    evidence = [f"mean admission wait {_ms(waited / d.requests)} of a mean TTFT of {_ms(d.ttft_sum / d.requests)} "
                f"over {d.requests:.0f} requests; {min(cold / waited, 1):.0%} of it before a replica was ready",
                f"started in the {d.window_s:.0f} s window: {starts or 'none (the wait ended as one came up)'}",
                "replicas now: " + (", ".join(f"{r.replica_id} {r.state}, {r.concurrency:.1f} requests in flight on "
                                              f"average (max_num_seqs {r.max_num_seqs})" for r in d.replicas)
                                    or "none")]
    scale_to_zero = d.settings.get("min_replicas") == "0"
    fix = ("the deployment scales to zero (replicas.min 0): keep replicas.min at 1 where a first request must not "
           "wait for a cold start" if scale_to_zero else
           "a cold start: expected once per new replica; if it recurs, keep more replicas warm (replicas.min) or "
           "shorten the start (a smaller model, weights on local disk)")
    return Finding("infrastructure", "cold start", d.name, summary, evidence, fix, share)


def _admission(d: DeploymentFigures, t: Thresholds) -> Finding | None:
    if d.requests < t.min_requests or d.ttft_sum <= 0:
        return None
    share = d.layers.get("admission_wait", 0.0) / d.ttft_sum
    if share < t.admission_share:
        return None
    cold = _cold_start(d, t, share)
    if cold is not None:
        return cold
    ready = _ready(d)
    max_replicas = int(d.settings["max_replicas"]) if d.settings.get("max_replicas", "").isdigit() else None
    at_max = max_replicas is not None and len(ready) >= max_replicas
    summary = (f"{share:.0%} of TTFT is admission wait; "
               + ("its replica was saturated" if len(ready) == 1 else f"all {len(ready)} replicas were saturated")
               + (" and the deployment is at max replicas" if at_max else ""))
    evidence = [
        f"mean admission wait {_ms(d.layers.get('admission_wait', 0.0) / d.requests)} of a mean TTFT of "
        f"{_ms(d.ttft_sum / d.requests)} over {d.requests:.0f} requests",
        f"{d.queued:.0f} requests waited in the admission queue (a request waits there only while every replica "
        f"is saturated); queue depth now {d.queue_depth:.0f}",
        "replicas now: " + ", ".join(f"{r.replica_id} running {r.running:.0f}/{r.max_num_seqs} waiting "
                                     f"{r.waiting:.0f}" for r in ready),
    ]
    fix = (f"raise max_replicas (now {max_replicas})" if at_max else
           "add replicas (the scaler's signal is this queue: check that it runs and may scale up)")
    return Finding("infrastructure", "admission", d.name, summary, evidence, fix, share)


def _routing(d: DeploymentFigures, t: Thresholds) -> Finding | None:
    hit = _hit_rate(d)
    if d.requests < t.min_requests or hit is None or not d.lookups:
        return None
    reachable = d.reachable_sum / d.lookups
    if reachable < t.reachable_min or hit >= t.hit_gap * reachable:
        return None
    summary = (f"requests sharing prefixes are spread across replicas (hit rate {hit:.0%} where "
               f"{reachable:.0%} is reachable)")
    evidence = [f"routing policy {d.policy or 'unknown'}",
                f"prefix cache hit rate {hit:.0%} of prompt tokens over {len(d.replicas)} replicas",
                f"the replica holding the most of each prompt held {reachable:.0%} of it on average; the chosen "
                f"one held {d.matched_sum / d.lookups:.0%} ({d.lookups:.0f} routings looked up)"]
    if d.ttft_sum > 0:
        evidence.append(f"prefill is {d.layers.get('engine_prefill', 0.0) / d.ttft_sum:.0%} of TTFT")
    fix = (f"the routing policy is wrong: use kv_aware (now {d.policy})" if d.policy != "kv_aware" else
           "kv_aware routes but misses: check that KV events reach the schedulers (prefix index) and the load weight")
    return Finding("infrastructure", "routing", d.name, summary, evidence, fix, reachable - hit)


def _token_latency(d: DeploymentFigures, t: Thresholds) -> Finding | None:
    itl, count = _itl(d)
    serving = [r for r in d.replicas if r.requests > 0]
    if count < t.min_requests or itl <= t.itl_slo_s or not serving:
        return None
    concurrency = sum(r.concurrency for r in serving) / len(serving)
    max_seqs = max(r.max_num_seqs for r in serving)
    weight = d.layers.get("engine_decode", 0.0) / d.e2e_sum if d.e2e_sum > 0 else 0.5
    step, top, top_share = _step_summary(serving)
    evidence = [f"mean inter-token latency {_ms(itl)} (target {_ms(t.itl_slo_s)}) over {count:.0f} tokens",
                f"{concurrency:.1f} requests in flight per replica on average (max_num_seqs {max_seqs})"]
    if step:
        evidence.append(step)
    if concurrency < t.low_concurrency * max_seqs:
        summary = (f"inter-token latency {_ms(itl)} at low concurrency ({concurrency:.1f} per replica): "
                   f"the engine is slow, not the fleet")
        fix = STEP_FIXES.get(top, "profile the engine step")
        return Finding("runtime", "engine", d.name, summary, evidence, fix, weight)
    summary = f"inter-token latency {_ms(itl)} with full batches ({concurrency:.1f} per replica): too little capacity"
    return Finding("infrastructure", "capacity", d.name, summary, evidence,
                   "add replicas (or lower max_num_seqs to trade throughput for latency)", weight * 0.9)


def _engine_queue(d: DeploymentFigures, t: Thresholds) -> Finding | None:
    if d.requests < t.min_requests or d.ttft_sum <= 0:
        return None
    share = d.layers.get("engine_queue", 0.0) / d.ttft_sum
    if share < t.engine_queue_share:
        return None
    kv = max((r.kv_usage for r in d.replicas), default=0.0)
    preemptions = sum(r.preemptions for r in d.replicas)
    evidence = [f"mean engine queue {_ms(d.layers.get('engine_queue', 0.0) / d.requests)} of a mean TTFT of "
                f"{_ms(d.ttft_sum / d.requests)}", f"KV cache use up to {kv:.0%} now; {preemptions:.0f} preemptions"]
    fix = ("the KV cache is the limit: more KV blocks (memory), shorter max_model_len, or more replicas"
           if kv > 0.9 or preemptions else "the batch is full: raise max_num_seqs if latency allows, or add replicas")
    return Finding("runtime", "engine", d.name, f"{share:.0%} of TTFT is spent queued inside the engines",
                   evidence, fix, share)


def _revisions(d: DeploymentFigures, t: Thresholds) -> Finding | None:
    by_rev: dict[str, list[EngineFigures]] = {}
    for r in d.replicas:
        if r.revision:
            by_rev.setdefault(r.revision, []).append(r)
    stats = {}
    for rev, replicas in by_rev.items():
        requests = sum(r.requests for r in replicas)
        if requests >= t.min_requests:
            stats[rev] = (requests, sum(r.errors for r in replicas) / requests,
                          sum(r.busy_s for r in replicas) / requests)
    if len(stats) < 2:
        return None
    total = sum(s[0] for s in stats.values())
    worst = max(stats, key=lambda k: stats[k][1])
    best = min(stats, key=lambda k: stats[k][1])
    (w_req, w_err, _), (_, b_err, _) = stats[worst], stats[best]
    evidence = [f"revision {k}: {s[0]:.0f} requests, {s[1]:.1%} errors, mean {_ms(s[2])}" for k, s in stats.items()]
    if w_err >= t.error_rate_min and w_err >= t.error_ratio * b_err:
        errors = (f"{w_err / b_err:.0f}x the errors of revision {best}" if b_err > 0 else
                  f"{w_err:.0%} errors where revision {best} has none")
        summary = f"revision {worst} serves {w_req / total:.0%} of traffic with {errors}"
        return Finding("tooling", "revision", d.name, summary, evidence, f"roll back revision {worst}",
                       1.0 + w_req / total)
    slow = max(stats, key=lambda k: stats[k][2])
    fast = min(stats, key=lambda k: stats[k][2])
    if stats[slow][2] >= t.latency_ratio * stats[fast][2] > 0:
        summary = (f"revision {slow} serves {stats[slow][0] / total:.0%} of traffic "
                   f"{stats[slow][2] / stats[fast][2]:.1f}x slower than revision {fast}")
        return Finding("tooling", "revision", d.name, summary, evidence, f"roll back revision {slow}",
                       1.0 + stats[slow][0] / total)
    return None


ANALYSIS_ACTOR = "canary-analysis"  # services.control.canary_driver's name in the history


def _automatic_rollback(d: DeploymentFigures, t: Thresholds) -> Finding | None:
    """The canary analysis rolled a revision back in the window: a tooling-layer event (a bad
    deploy the tooling caught), which explains what the canary's requests saw before it."""
    rollbacks = [e for e in d.events if e.get("actor") == ANALYSIS_ACTOR and e.get("action") == "rollback"]
    if not rollbacks:
        return None
    e = rollbacks[-1]
    a = e.get("analysis", {})
    ago = f"{max(d.now - e['at'], 0):.0f} s ago" if d.now else "in the window"
    summary = (f"the canary analysis rolled revision {a.get('canary_revision', '?')} back {ago} at {a.get('step')}% "
               f"of traffic: it was worse than revision {a.get('stable_revision', '?')}")
    evidence = [a.get("reason", "")] + [c["detail"] for c in a.get("checks", []) if not c.get("failed")]
    evidence.append(f"{a.get('canary_requests', 0)} canary and {a.get('stable_requests', 0)} stable requests over "
                    f"{a.get('window_s', 0):.0f} s; traffic is back on revision {e.get('stable')}")
    return Finding("tooling", "canary rollback", d.name, summary, [x for x in evidence if x],
                   f"nothing to undo: revision {a.get('canary_revision', '?')} serves no traffic; fix it and deploy a "
                   f"new revision (`strata history {d.name}` has the analysis' figures)",
                   2.0 + (a.get("step") or 0) / 100)  # above a bad revision still serving: it explains that


RULES = (_automatic_rollback, _revisions, _admission, _routing, _token_latency, _engine_queue)


# ---- state -------------------------------------------------------------------------------------
def _state(figures: Figures) -> dict[str, list[str]]:
    state: dict[str, list[str]] = {layer: [] for layer in LAYERS}
    for d in figures.deployments:
        for r in d.replicas:
            hit = f", prefix hit {r.prefix_hits / r.prefix_queries:.0%}" if r.prefix_queries else ""
            itl = f", ITL {_ms(r.itl_sum / r.itl_count)}" if r.itl_count else ""
            step = _step_summary([r])[0]
            rev = f" rev {r.revision}" if r.revision else ""
            state["runtime"].append(
                f"engine {r.replica_id} ({d.name}{rev}) {r.state}: running {r.running:.0f}/{r.max_num_seqs}, "
                f"waiting {r.waiting:.0f}, KV {r.kv_usage:.0%}{hit}{itl}, {r.requests:.0f} requests "
                f"({r.errors:.0f} errors)" + (f"; {step}" if step else ""))
    for s in figures.services:
        layer = "tooling" if s.kind == "control" else "infrastructure"
        state[layer].append(f"{s.kind} {s.instance} {s.url}: {'up' if s.up else 'DOWN'}"
                            + (f", {s.detail}" if s.detail else ""))
    for d in figures.deployments:
        line = f"deployment {d.name}: {len(_ready(d))} ready replicas, policy {d.policy or '?'}"
        if d.requests:
            line += (f", {d.requests:.0f} requests, mean TTFT {_ms(d.ttft_sum / d.requests)}, "
                     f"mean e2e {_ms(d.e2e_sum / d.requests)}, admission queue {d.queue_depth:.0f}")
        state["infrastructure"].append(line)
        revisions = sorted({r.revision for r in d.replicas if r.revision})
        settings = ", ".join(f"{k}={v}" for k, v in sorted(d.settings.items()))
        state["tooling"].append(f"deployment {d.name}: " + (settings or "no stored settings")
                                + (f"; revisions serving: {', '.join(revisions)}" if revisions else ""))
    return state


def _split(d: DeploymentFigures) -> dict[str, float]:
    total = sum(d.layers.get(name, 0.0) for name in LAYER_NAMES)
    if total <= 0:
        return {}
    out: dict[str, float] = {}
    for name in LAYER_NAMES:
        out[COMPONENT[name]] = out.get(COMPONENT[name], 0.0) + d.layers.get(name, 0.0) / total
    return out


def diagnose(figures: Figures, thresholds: Thresholds | None = None) -> Report:
    t = thresholds or Thresholds()
    findings = [f for d in figures.deployments for rule in RULES if (f := rule(d, t)) is not None]
    findings.sort(key=lambda f: -f.weight)
    return Report(figures.window_s, _state(figures), findings,
                  {d.name: _split(d) for d in figures.deployments if d.requests})


def render(report: Report) -> str:
    lines = [f"strata diagnose: the last {report.window_s:.0f} s"]
    for layer in LAYERS:
        lines.append(f"\n{layer}")
        lines.extend(f"  {line}" for line in report.state[layer] or ["(nothing registered)"])
    lines.append("")
    verdict = report.verdict
    if verdict is None:
        splits = "; ".join(f"{name}: " + ", ".join(f"{k} {v:.0%}" for k, v in split.items())
                           for name, split in report.split.items())
        lines.append("verdict: no layer stands out" + (f" (time by layer: {splits})" if splits else ""))
        return "\n".join(lines)
    for i, f in enumerate(report.findings):
        head = "verdict" if i == 0 else "also"
        lines.append(f"{head}: {f.layer}: {f.summary} [{f.deployment}]")
        lines.extend(f"  - {e}" for e in f.evidence)
        lines.append(f"  fix: {f.fix}")
    return "\n".join(lines)
