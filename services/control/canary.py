"""Canary analysis: is the canary revision worse than stable? Pure: samples in, verdicts out.

A deployment's `canary.analysis` walks the canary through traffic steps (5 -> 25 -> 50 -> 100%).
At each step below 100% control compares the canary with stable over the same window, once both
have served `min_requests` requests since the step began:

- TTFT: the canary's p90 over stable's, and a one-sided Mann-Whitney U rank test on the
  per-request samples (is the canary's TTFT stochastically greater?);
- inter-token latency: the token-weighted p50 ratio (each request's mean gap counts once per
  gap, so long answers weigh as much as the tokens they stream), and the same rank test on
  per-request values (requests, not tokens, are the independent units);
- errors: the difference of the error rates, and an exact binomial test conditional on the
  errors of both revisions (under equal rates each error falls on the canary with probability
  n_canary / (n_canary + n_stable));
- optionally an operator's Prometheus expression, which fails the step above its `max`.

A check fails only when its effect passes the threshold *and* its test is significant, so a
noisy window cannot roll back a canary that is as good as stable, and a tiny real difference
cannot either. `alpha` bounds the chance that a canary no worse than stable is rolled back at
all over the whole analysis: each step decides once, and each of its three tests runs at
alpha / (steps analysed x 3) (Bonferroni). A failed step rolls back, a passed one moves to the
next step, and passing the last step below 100% promotes.

The driver (services.control.canary_driver) feeds the gateways' per-revision samples
(GatewayStats.samples and outcomes, on the bus) into a SampleBook and acts on the verdicts.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from shared.protocol import GatewayStats

# ---- configuration -----------------------------------------------------------------------------


@dataclass
class Thresholds:
    ttft_p90_ratio: float = 1.5  # canary TTFT p90 / stable's above this fails (when significant)
    itl_p50_ratio: float = 1.5  # token-weighted inter-token latency p50 ratio
    error_rate_diff: float = 0.02  # canary error rate - stable's above this fails (when significant)


@dataclass
class PrometheusCheck:
    """An operator's own check: a PromQL expression whose value fails the step above `max`.
    `$deployment`, `$canary` and `$stable` in the query become the deployment's name and the two
    revision numbers (Prometheus in compose labels engine series with `revision`)."""

    url: str
    query: str
    max: float


@dataclass
class AnalysisConfig:
    steps: list[int] = field(default_factory=lambda: [5, 25, 50, 100])  # canary traffic %, increasing
    interval_s: float = 10.0  # how often control looks at the window
    min_requests: int = 50  # per revision, since the step began, before a step is judged
    alpha: float = 0.05  # chance of rolling back a canary as good as stable, over the whole analysis
    thresholds: Thresholds = field(default_factory=Thresholds)
    prometheus: PrometheusCheck | None = None

    TESTS_PER_STEP = 3  # TTFT, ITL, errors

    @property
    def analysed_steps(self) -> list[int]:
        """The steps judged; 100% is promotion itself (no stable traffic is left to compare)."""
        return [w for w in self.steps if w < 100]

    @property
    def alpha_per_test(self) -> float:
        return self.alpha / (max(len(self.analysed_steps), 1) * self.TESTS_PER_STEP)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {"steps": list, "interval_s": float, "min_requests": int, "alpha": float, "thresholds": dict,
           "prometheus": dict}


def _number(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, (int, float)) and math.isfinite(value)


def parse_analysis(raw: Any, where: str = "canary.analysis") -> tuple[AnalysisConfig | None, list[tuple[str, str]]]:
    """(the config, []) or (None, [(field, reason), ...]) for every problem at once."""
    if not isinstance(raw, dict):
        return None, [(where, "must be a mapping")]
    errors: list[tuple[str, str]] = []
    for key in raw:
        if key not in _FIELDS:
            errors.append((f"{where}.{key}", f"unknown field (known: {', '.join(_FIELDS)})"))
    cfg = AnalysisConfig()
    steps = raw.get("steps", cfg.steps)
    if (not isinstance(steps, list) or not steps or not all(_number(s, int) for s in steps)
            or not all(1 <= s <= 100 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:]))):
        errors.append((f"{where}.steps", "must be a list of increasing integer percentages from 1 to 100"))
    elif steps == [100]:
        errors.append((f"{where}.steps", "needs a step below 100: at 100% there is no stable traffic to compare"))
    else:
        cfg.steps = list(steps)
    for name, kind, valid, wanted in (("interval_s", float, lambda v: v > 0, "a number of seconds > 0"),
                                      ("min_requests", int, lambda v: v >= 1, "an integer >= 1"),
                                      ("alpha", float, lambda v: 0 < v < 1, "a number in (0, 1)")):
        if name in raw:
            if not _number(raw[name], kind) or not valid(raw[name]):
                errors.append((f"{where}.{name}", f"must be {wanted}"))
            else:
                setattr(cfg, name, kind(raw[name]))
    thresholds = raw.get("thresholds", {})
    if not isinstance(thresholds, dict):
        errors.append((f"{where}.thresholds", "must be a mapping"))
        thresholds = {}
    known = {f.name for f in dataclasses.fields(Thresholds)}
    for key, value in thresholds.items():
        if key not in known:
            errors.append((f"{where}.thresholds.{key}", f"unknown threshold (known: {', '.join(sorted(known))})"))
        elif not _number(value, float):
            errors.append((f"{where}.thresholds.{key}", "must be a number"))
        elif key.endswith("_ratio") and value < 1:
            errors.append((f"{where}.thresholds.{key}", "a ratio to stable must be at least 1"))
        elif key == "error_rate_diff" and not 0 <= value < 1:
            errors.append((f"{where}.thresholds.{key}", "must be in [0, 1)"))
        else:
            setattr(cfg.thresholds, key, float(value))
    prom = raw.get("prometheus")
    if prom is not None:
        if not isinstance(prom, dict):
            errors.append((f"{where}.prometheus", "must be a mapping with url, query and max"))
        else:
            for key in set(prom) - {"url", "query", "max"}:
                errors.append((f"{where}.prometheus.{key}", "unknown field (known: url, query, max)"))
            url, query, limit = prom.get("url"), prom.get("query"), prom.get("max")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                errors.append((f"{where}.prometheus.url", "required: the Prometheus server's http(s) URL"))
            if not isinstance(query, str) or not query.strip():
                errors.append((f"{where}.prometheus.query", "required: a PromQL expression"))
            if not _number(limit, float):
                errors.append((f"{where}.prometheus.max", "required: the value above which the step fails"))
            if not any(f"{where}.prometheus" in e[0] for e in errors):
                cfg.prometheus = PrometheusCheck(url.rstrip("/"), query, float(limit))
    return (None, errors) if errors else (cfg, [])


def analysis_from_spec(canary: dict[str, Any]) -> AnalysisConfig | None:
    """A stored revision's analysis (validated when it was applied), or None."""
    raw = canary.get("analysis")
    if raw is None:
        return None
    cfg, errors = parse_analysis(raw)
    if errors:  # stored specs were validated: a bug if this happens
        raise ValueError(f"stored canary analysis is invalid: {errors}")
    return cfg


# ---- samples -----------------------------------------------------------------------------------


@dataclass
class Window:
    """One revision's requests over a span of time."""

    ttft: np.ndarray  # seconds, one per request that streamed a token
    itl: np.ndarray  # mean inter-token gap per request with two tokens or more
    gaps: np.ndarray  # its number of gaps (output tokens - 1): the ITL weights
    requests: int  # exact count, errors included
    errors: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class RevisionSamples:
    """A revision's recent requests: latency samples (timestamped) and exact counts (per report)."""

    def __init__(self, keep_s: float = 1800.0, max_samples: int = 200_000):
        self.keep_s = keep_s
        self.latency: deque[tuple[float, float, float, int]] = deque(maxlen=max_samples)  # at, ttft, itl, tokens
        self.counts: deque[tuple[float, int, int]] = deque()  # report time, requests, errors

    def add_latency(self, at: float, ttft_s: float, itl_s: float, tokens: int) -> None:
        self.latency.append((at, ttft_s, itl_s, tokens))

    def add_counts(self, at: float, requests: int, errors: int) -> None:
        self.counts.append((at, requests, errors))

    def prune(self, now: float) -> None:
        cutoff = now - self.keep_s
        while self.latency and self.latency[0][0] < cutoff:
            self.latency.popleft()
        while self.counts and self.counts[0][0] < cutoff:
            self.counts.popleft()

    def first_at(self, start: float) -> float | None:
        """When this revision first finished a request at or after `start`."""
        return next((at for at, *_ in self.latency if at >= start), None) or next(
            (at for at, n, _ in self.counts if at >= start and n), None)

    def window(self, start: float, end: float) -> Window:
        rows = [(t, i, n) for at, t, i, n in self.latency if start <= at <= end]
        ttft = np.array([t for t, _, _ in rows], dtype=float)
        multi = [(i, n - 1) for _, i, n in rows if n > 1]
        requests = sum(n for at, n, _ in self.counts if start <= at <= end)
        errors = sum(e for at, _, e in self.counts if start <= at <= end)
        return Window(ttft, np.array([i for i, _ in multi], dtype=float),
                      np.array([g for _, g in multi], dtype=float), max(requests, len(rows)), errors)


class SampleBook:
    """Every managed revision's samples, from the gateways' reports."""

    def __init__(self, keep_s: float = 1800.0):
        self.keep_s = keep_s
        self.revisions: dict[tuple[str, int], RevisionSamples] = {}

    def _of(self, deployment: str, revision: int) -> RevisionSamples:
        return self.revisions.setdefault((deployment, revision), RevisionSamples(self.keep_s))

    def add(self, report: GatewayStats) -> None:
        for model, samples in report.samples.items():
            for s in samples:
                self._of(model, s.revision).add_latency(s.finished_at, s.ttft_s, s.itl_s, s.output_tokens)
        for model, by_revision in report.outcomes.items():
            for revision, outcome in by_revision.items():
                self._of(model, revision).add_counts(report.timestamp, outcome.requests, outcome.errors)

    def get(self, deployment: str, revision: int) -> RevisionSamples:
        return self._of(deployment, revision)

    def prune(self, now: float, keep: set[tuple[str, int]] | None = None) -> None:
        for key, samples in list(self.revisions.items()):
            samples.prune(now)
            if not samples.latency and not samples.counts and (keep is None or key not in keep):
                del self.revisions[key]


# ---- statistics --------------------------------------------------------------------------------


def weighted_quantile(values: np.ndarray, weights: np.ndarray | None, q: float) -> float | None:
    """The smallest value whose cumulative weight reaches q of the total (None without values)."""
    if len(values) == 0:
        return None
    order = np.argsort(values, kind="stable")
    v = np.asarray(values, dtype=float)[order]
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)[order]
    cumulative = np.cumsum(w)
    return float(v[min(int(np.searchsorted(cumulative, q * cumulative[-1], side="left")), len(v) - 1)])


def rank_test(canary: np.ndarray, stable: np.ndarray) -> float:
    """One-sided Mann-Whitney U: the p-value of 'the canary's values are stochastically greater'."""
    return float(stats.mannwhitneyu(canary, stable, alternative="greater").pvalue)


def error_test(canary_errors: int, canary_requests: int, stable_errors: int, stable_requests: int) -> float:
    """Exact binomial test, conditional on the errors of both: under equal error rates each
    error is the canary's with probability n_c / (n_c + n_s). The p-value of 'the canary errs more'."""
    total = canary_errors + stable_errors
    if total == 0 or canary_requests == 0 or stable_requests == 0:
        return 1.0
    share = canary_requests / (canary_requests + stable_requests)
    return float(stats.binomtest(canary_errors, total, share, alternative="greater").pvalue)


# ---- verdicts ----------------------------------------------------------------------------------


@dataclass
class Check:
    name: str  # ttft_p90 | itl_p50 | error_rate | prometheus
    canary: float | None
    stable: float | None
    effect: float | None  # ratio (latency), difference (errors) or the value (prometheus)
    threshold: float
    p_value: float | None
    failed: bool
    detail: str


@dataclass
class Verdict:
    decision: str  # wait | pass | fail
    reason: str
    step: int  # the canary's traffic percent judged
    checks: list[Check] = field(default_factory=list)
    canary_requests: int = 0
    stable_requests: int = 0
    window_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MIN_LATENCY_SAMPLES = 5  # fewer successful requests on a side: the latency checks are skipped


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.1f} ms"


def _latency_check(name: str, label: str, canary: np.ndarray, stable: np.ndarray, q: float,
                   canary_w: np.ndarray | None, stable_w: np.ndarray | None, threshold: float,
                   alpha: float) -> Check | None:
    if len(canary) < MIN_LATENCY_SAMPLES or len(stable) < MIN_LATENCY_SAMPLES:
        return None
    c, s = weighted_quantile(canary, canary_w, q), weighted_quantile(stable, stable_w, q)
    ratio = c / s if s > 0 else (math.inf if c > 0 else 1.0)
    p = rank_test(canary, stable)
    failed = ratio > threshold and p < alpha
    detail = (f"{label} {_ms(c)} vs stable {_ms(s)} ({ratio:.2f}x, limit {threshold:g}x; rank test p={p:.2g}, "
              f"alpha {alpha:.2g})")
    return Check(name, c, s, ratio, threshold, p, failed, detail)


def judge(config: AnalysisConfig, step: int, canary: Window, stable: Window, window_s: float,
          prometheus_value: float | None = None, prometheus_error: str | None = None) -> Verdict:
    """The verdict on one step's window: wait (too few requests), pass, or fail (with why)."""
    verdict = Verdict("wait", "", step, canary_requests=canary.requests, stable_requests=stable.requests,
                      window_s=round(window_s, 3))
    if canary.requests < config.min_requests or stable.requests < config.min_requests:
        verdict.reason = (f"waiting for {config.min_requests} requests on each revision "
                          f"(canary {canary.requests}, stable {stable.requests})")
        return verdict
    alpha, t = config.alpha_per_test, config.thresholds
    checks = [c for c in (
        _latency_check("ttft_p90", "TTFT p90", canary.ttft, stable.ttft, 0.9, None, None, t.ttft_p90_ratio, alpha),
        _latency_check("itl_p50", "inter-token latency p50 (token-weighted)", canary.itl, stable.itl, 0.5,
                       canary.gaps, stable.gaps, t.itl_p50_ratio, alpha)) if c is not None]
    diff = canary.error_rate - stable.error_rate
    p = error_test(canary.errors, canary.requests, stable.errors, stable.requests)
    checks.append(Check("error_rate", canary.error_rate, stable.error_rate, diff, t.error_rate_diff, p,
                        diff > t.error_rate_diff and p < alpha,
                        f"error rate {canary.error_rate:.1%} vs stable {stable.error_rate:.1%} ({diff:+.1%}, limit "
                        f"+{t.error_rate_diff:.1%}; binomial test p={p:.2g}, alpha {alpha:.2g})"))
    if config.prometheus is not None:
        if prometheus_error is not None:
            verdict.checks = checks
            verdict.reason = f"the Prometheus check cannot be read ({prometheus_error}): holding at {step}%"
            return verdict
        checks.append(Check("prometheus", prometheus_value, None, prometheus_value, config.prometheus.max, None,
                            prometheus_value is not None and prometheus_value > config.prometheus.max,
                            f"{config.prometheus.query} = {prometheus_value:.4g} (max {config.prometheus.max:g})"
                            if prometheus_value is not None else f"{config.prometheus.query}: no value"))
    verdict.checks = checks
    failed = [c for c in checks if c.failed]
    if failed:
        verdict.decision, verdict.reason = "fail", "; ".join(c.detail for c in failed)
    else:
        verdict.decision = "pass"
        verdict.reason = (f"no check failed at {step}% over {canary.requests} canary and {stable.requests} stable "
                          f"requests")
    return verdict


# ---- the walk through the steps ----------------------------------------------------------------


@dataclass
class Action:
    kind: str  # set_weight | promote | rollback
    weight: int = 0
    reason: str = ""


def next_action(config: AnalysisConfig, step_index: int, verdict: Verdict) -> Action | None:
    """What a verdict at analysed step `step_index` leads to (None: keep waiting)."""
    if verdict.decision == "fail":
        return Action("rollback", 0, verdict.reason)
    if verdict.decision != "pass":
        return None
    steps = config.analysed_steps
    if step_index + 1 < len(steps):
        return Action("set_weight", steps[step_index + 1], f"step {steps[step_index]}% passed")
    return Action("promote", 100, f"the last step ({steps[step_index]}%) passed")
