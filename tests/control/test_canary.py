"""The canary analysis' statistics and steps on crafted samples (services.control.canary, pure)."""

import numpy as np
import pytest

from bench.canary import synthetic_window as window
from services.control.canary import (AnalysisConfig, SampleBook, Thresholds, Window, error_test, judge, next_action,
                                     parse_analysis, rank_test, weighted_quantile)
from shared.protocol import GatewayStats, LatencySample, RevisionOutcomes

TRIALS = 100


def test_no_false_rollback_on_identical_distributions_in_100_seeded_trials():
    """The configured alpha with the default thresholds: a canary drawn from stable's own
    distributions (latency and a 2% error rate) is never rolled back, at any step."""
    config = AnalysisConfig()
    for seed in range(TRIALS):
        rng = np.random.default_rng(seed)
        for step in config.analysed_steps:
            canary_n = max(config.min_requests, 2 * config.min_requests * step // (100 - step))
            verdict = judge(config, step, window(rng, canary_n, error_rate=0.02),
                            window(rng, 2 * config.min_requests, error_rate=0.02), 30.0)
            assert verdict.decision == "pass", (seed, step, verdict.reason)


def test_the_tests_alone_are_calibrated_at_alpha():
    """Without the effect thresholds (ratios 1, difference 0) only the tests decide: identical
    distributions then fail about alpha of the time -- the tests are real, not rigged to pass."""
    config = AnalysisConfig(steps=[50, 100], alpha=0.3, thresholds=Thresholds(1.0, 1.0, 0.0))  # 0.1 per test
    rng = np.random.default_rng(7)
    trials = 600
    failed = {"ttft_p90": 0, "itl_p50": 0, "error_rate": 0}
    for _ in range(trials):
        verdict = judge(config, 50, window(rng, 80, error_rate=0.05), window(rng, 80, error_rate=0.05), 30.0)
        for check in verdict.checks:
            failed[check.name] += check.failed
    for name, n in failed.items():
        # The rank tests need the ratio > 1 too (about half the cases where p < 0.1 already have it);
        # the binomial test is conservative (discrete): each stays at or below 0.1, and above zero.
        assert 0 < n / trials <= 0.1 + 3 * (0.1 * 0.9 / trials) ** 0.5, (name, n / trials)


@pytest.mark.parametrize("slow", [1.6, 2.0, 3.0])
def test_a_slower_canary_is_rolled_back(slow):
    config = AnalysisConfig()
    caught = 0
    for seed in range(TRIALS):
        rng = np.random.default_rng(1000 + seed)
        verdict = judge(config, 25, window(rng, config.min_requests, slow=slow), window(rng, 150), 30.0)
        caught += verdict.decision == "fail"
    assert caught >= (90 if slow >= 2 else 60), caught
    rng = np.random.default_rng(0)
    verdict = judge(config, 25, window(rng, 60, slow=3.0), window(rng, 150), 30.0)
    assert verdict.decision == "fail" and "TTFT p90" in verdict.reason and "rank test p=" in verdict.reason
    assert {c.name for c in verdict.checks if c.failed} == {"ttft_p90", "itl_p50"}


def test_a_canary_that_errs_is_rolled_back_and_one_that_errs_like_stable_is_not():
    config = AnalysisConfig()
    rng = np.random.default_rng(3)
    verdict = judge(config, 5, window(rng, 60, error_rate=0.2), window(rng, 500, error_rate=0.01), 30.0)
    assert verdict.decision == "fail"
    (check,) = [c for c in verdict.checks if c.failed]
    assert check.name == "error_rate" and check.effect > 0.1 and check.p_value < config.alpha_per_test
    # Every request fails: no latency sample at all, the error check alone decides.
    verdict = judge(config, 5, Window(np.array([]), np.array([]), np.array([]), 60, 60), window(rng, 500), 30.0)
    assert verdict.decision == "fail" and [c.name for c in verdict.checks] == ["error_rate"]


def test_too_few_requests_waits():
    config = AnalysisConfig(min_requests=50)
    rng = np.random.default_rng(0)
    verdict = judge(config, 5, window(rng, 49, slow=5.0), window(rng, 900), 30.0)
    assert verdict.decision == "wait" and "canary 49, stable 900" in verdict.reason
    assert next_action(config, 0, verdict) is None


def test_itl_p50_is_token_weighted():
    # Nine one-gap requests at 10 ms, one with 99 gaps at 50 ms: per request the median is 10 ms,
    # per token 50 ms (99 of the 108 gaps are the long answer's).
    itl = np.array([0.01] * 9 + [0.05])
    gaps = np.array([1.0] * 9 + [99.0])
    assert weighted_quantile(itl, None, 0.5) == 0.01
    assert weighted_quantile(itl, gaps, 0.5) == 0.05
    assert weighted_quantile(np.array([]), None, 0.5) is None
    assert weighted_quantile(np.arange(1.0, 11.0), None, 0.9) == 9.0


def test_the_tests_themselves():
    rng = np.random.default_rng(1)
    assert rank_test(rng.normal(2, 1, 50), rng.normal(0, 1, 50)) < 1e-6
    assert rank_test(rng.normal(0, 1, 50), rng.normal(2, 1, 50)) > 0.99  # one-sided: faster is no failure
    assert error_test(0, 100, 0, 100) == 1.0
    assert error_test(10, 100, 1, 1000) < 1e-6
    assert error_test(1, 100, 10, 1000) > 0.5


def test_steps_promote_after_the_last_analysed_one():
    config = AnalysisConfig(steps=[5, 25, 50, 100])
    assert config.analysed_steps == [5, 25, 50]
    assert config.alpha_per_test == pytest.approx(0.05 / 9)
    rng = np.random.default_rng(0)
    passed = judge(config, 5, window(rng, 80), window(rng, 200), 10.0)
    assert passed.decision == "pass"
    assert next_action(config, 0, passed).kind == "set_weight" and next_action(config, 0, passed).weight == 25
    assert next_action(config, 1, passed).weight == 50
    assert next_action(config, 2, passed).kind == "promote"
    failed = judge(config, 5, window(rng, 80, slow=4), window(rng, 200), 10.0)
    action = next_action(config, 1, failed)
    assert action.kind == "rollback" and action.reason == failed.reason


def test_the_prometheus_check_fails_a_step_above_its_max_and_holds_it_when_unreadable():
    config, errors = parse_analysis({"prometheus": {"url": "http://prom:9090", "query": "up{revision='$canary'}",
                                                    "max": 0.5}})
    assert not errors
    rng = np.random.default_rng(0)
    canary, stable = window(rng, 80), window(rng, 200)
    assert judge(config, 5, canary, stable, 10.0, prometheus_value=0.2).decision == "pass"
    failed = judge(config, 5, canary, stable, 10.0, prometheus_value=0.9)
    assert failed.decision == "fail" and "up{revision='$canary'} = 0.9 (max 0.5)" in failed.reason
    held = judge(config, 5, canary, stable, 10.0, prometheus_error="ClientConnectorError: refused")
    assert held.decision == "wait" and "cannot be read" in held.reason


def test_the_spec_section_is_checked_field_by_field():
    config, errors = parse_analysis({"steps": [10, 50], "interval_s": 2, "min_requests": 20, "alpha": 0.01,
                                     "thresholds": {"ttft_p90_ratio": 2}})
    assert not errors and config.steps == [10, 50] and config.thresholds.ttft_p90_ratio == 2.0
    assert config.thresholds.itl_p50_ratio == 1.5  # defaults fill the rest
    _, errors = parse_analysis({"steps": [50, 20], "alpha": 2, "min_requests": 0, "thresholds": {"p99": 1,
                                "itl_p50_ratio": 0.5}, "prometheus": {"url": "prom", "max": "x"}, "color": 1})
    fields = {f for f, _ in errors}
    assert fields == {"canary.analysis.steps", "canary.analysis.alpha", "canary.analysis.min_requests",
                      "canary.analysis.thresholds.p99", "canary.analysis.thresholds.itl_p50_ratio",
                      "canary.analysis.prometheus.url", "canary.analysis.prometheus.query",
                      "canary.analysis.prometheus.max", "canary.analysis.color"}, errors
    assert parse_analysis({"steps": [100]})[1][0][0] == "canary.analysis.steps"


def test_the_sample_book_windows_by_revision_and_time():
    book = SampleBook()
    report = GatewayStats(gateway_id="g", timestamp=105.0, samples={"chat": [
        LatencySample(revision=2, finished_at=100.0 + i, ttft_s=0.1, itl_s=0.01, output_tokens=5) for i in range(10)]
        + [LatencySample(revision=1, finished_at=101.0, ttft_s=0.05, itl_s=0.0, output_tokens=1)]},
        outcomes={"chat": {2: RevisionOutcomes(requests=11, errors=1), 1: RevisionOutcomes(requests=1)}})
    book.add(report)
    canary = book.get("chat", 2)
    assert canary.first_at(103.5) == 104.0
    w = canary.window(100.0, 200.0)
    assert (len(w.ttft), len(w.itl), w.requests, w.errors) == (10, 10, 11, 1) and w.gaps[0] == 4.0
    assert len(book.get("chat", 1).window(100.0, 200.0).itl) == 0  # a one-token answer has no gap
    assert len(canary.window(106.0, 200.0).ttft) == 4
    book.prune(10_000.0)
    assert book.revisions == {}
