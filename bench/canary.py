"""The canary analysis' false-alarm rate and power, through its own code (services.control.canary).

Each run is a whole analysis with the default configuration (steps 5 -> 25 -> 50%, then
promotion; min_requests 50, alpha 0.05, thresholds 1.5x / 1.5x / +2%): at each step both
revisions get the requests their traffic shares give them (the canary min_requests, stable its
share's worth, at least min_requests), drawn from a realistic mix (log-normal TTFT and inter-token
gaps, 1-64 output tokens). A false alarm is a rollback of a canary drawn from stable's own
distributions; power is the share of runs that roll a worse canary back, and at which step.

    python bench/canary.py [--runs 3000] [--seed 0]

Prints the figures, writes bench/results/canary.json and canary.png (power by slowdown).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import pyplot, write_results  # noqa: E402
from services.control.canary import AnalysisConfig, Thresholds, Window, judge  # noqa: E402


def synthetic_window(rng: np.random.Generator, n: int, slow: float = 1.0, error_rate: float = 0.0,
                     ttft_s: float = 0.08, itl_s: float = 0.012) -> Window:
    """n requests as a gateway sees them: log-normal TTFT and inter-token gaps (scaled by
    `slow`), 1-64 output tokens, a share `error_rate` failing (no latency sample)."""
    tokens = rng.integers(1, 65, n)
    ttft = rng.lognormal(np.log(ttft_s), 0.6, n) * slow
    itl = rng.lognormal(np.log(itl_s), 0.35, n) * slow
    errors = int(rng.binomial(n, error_rate))
    ok = n - errors
    multi = tokens[:ok] > 1
    return Window(ttft[:ok], itl[:ok][multi], (tokens[:ok][multi] - 1).astype(float), n, errors)


def run_analysis(config: AnalysisConfig, rng: np.random.Generator, slow: float = 1.0, canary_errors: float = 0.01,
                 stable_errors: float = 0.01) -> int | None:
    """The step (percent) at which the canary is rolled back, or None (promoted)."""
    for step in config.analysed_steps:
        canary_n = config.min_requests
        stable_n = max(config.min_requests, round(canary_n * (100 - step) / step))
        verdict = judge(config, step, synthetic_window(rng, canary_n, slow, canary_errors),
                        synthetic_window(rng, stable_n, 1.0, stable_errors), 30.0)
        if verdict.decision == "fail":
            return step
    return None


def upper_95(failures: int, runs: int) -> float:
    """Clopper-Pearson upper bound of a rate seen `failures` times in `runs`."""
    return float(stats.beta.ppf(0.975, failures + 1, runs - failures)) if failures < runs else 1.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3000, help="analyses per scenario for the false-alarm rate")
    p.add_argument("--power-runs", type=int, default=400, help="analyses per worse-canary scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "canary.json"))
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    config = AnalysisConfig()
    started = time.perf_counter()

    alarms = sum(run_analysis(config, rng) is not None for _ in range(args.runs))
    # The tests alone (effect thresholds off): they should fail about alpha of the time.
    bare = AnalysisConfig(thresholds=Thresholds(1.0, 1.0, 0.0))
    bare_alarms = sum(run_analysis(bare, rng) is not None for _ in range(args.runs))
    judged = 2 * args.runs * len(config.analysed_steps)

    power = []
    for slow in (1.1, 1.25, 1.5, 1.75, 2.0, 3.0):
        steps = [run_analysis(config, rng, slow=slow) for _ in range(args.power_runs)]
        caught = [s for s in steps if s is not None]
        power.append({"slowdown": slow, "rolled_back": len(caught) / len(steps),
                      "at_first_step": sum(s == config.analysed_steps[0] for s in caught) / len(steps)})
    errors = []
    for rate in (0.03, 0.05, 0.1, 0.2):
        steps = [run_analysis(config, rng, canary_errors=rate) for _ in range(args.power_runs)]
        caught = [s for s in steps if s is not None]
        errors.append({"canary_error_rate": rate, "stable_error_rate": 0.01, "rolled_back": len(caught) / len(steps),
                       "at_first_step": sum(s == config.analysed_steps[0] for s in caught) / len(steps)})
    elapsed = time.perf_counter() - started

    print(f"default analysis ({' -> '.join(f'{w}%' for w in config.analysed_steps)}, min_requests "
          f"{config.min_requests}, alpha {config.alpha}):")
    print(f"  false alarms: {alarms} of {args.runs} analyses of a canary identical to stable "
          f"(rate {alarms / args.runs:.4f}, 95% upper bound {upper_95(alarms, args.runs):.4f})")
    print(f"  the tests alone (thresholds off): {bare_alarms} of {args.runs} "
          f"(rate {bare_alarms / args.runs:.4f}; the bound is alpha = {config.alpha})")
    for row in power:
        print(f"  {row['slowdown']:.2f}x slower: rolled back in {row['rolled_back']:.1%} "
              f"({row['at_first_step']:.1%} at the first step)")
    for row in errors:
        print(f"  {row['canary_error_rate']:.0%} errors vs 1%: rolled back in {row['rolled_back']:.1%} "
              f"({row['at_first_step']:.1%} at the first step)")
    print(f"  {judged + 10 * args.power_runs * len(config.analysed_steps)} verdicts at most in {elapsed:.1f} s")
    write_results(args.out, args, {
        "analysis": config.to_dict(), "runs": args.runs,
        "false_alarms": alarms, "false_alarm_rate": alarms / args.runs,
        "false_alarm_rate_upper_95": upper_95(alarms, args.runs),
        "tests_alone_false_alarm_rate": bare_alarms / args.runs, "power_by_slowdown": power,
        "power_by_error_rate": errors, "seconds": round(elapsed, 1)})
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([r["slowdown"] for r in power], [r["rolled_back"] for r in power], "o-", label="rolled back")
    ax.plot([r["slowdown"] for r in power], [r["at_first_step"] for r in power], "s--", label="at the first step (5%)")
    ax.axhline(alarms / args.runs, color="grey", lw=0.8, ls=":", label=f"false alarms at 1.0x ({alarms / args.runs:.2%})")
    ax.set_xlabel("canary latency / stable's (TTFT and inter-token)")
    ax.set_ylabel("share of analyses")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Canary analysis, default configuration")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    png = Path(args.out).with_suffix(".png")
    fig.savefig(png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
