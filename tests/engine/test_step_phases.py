"""The engine step broken down by phase: every phase is measured and together they are the step."""

import statistics

from services.engine.config import EngineArgs
from services.engine.llm_engine import LLMEngine
from services.engine.metrics import EngineMetrics
from services.engine.model_runner import STEP_PHASES, StepTimings
from services.engine.sampling_params import SamplingParams


def run_steps(engine: LLMEngine) -> list[StepTimings]:
    for i, n in enumerate((5, 40, 130)):
        engine.add_request(f"r{i}", list(range(10, 10 + n)), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                           temperature=0.0))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
    return steps


def test_phases_are_measured_and_add_up_to_the_step(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, EngineArgs(num_kv_blocks=64))
    steps = run_steps(engine)
    assert len(steps) == 12  # one prefill step (with its first token), then 11 decode steps
    for step in steps:
        phases = [getattr(step, p) for p in STEP_PHASES]
        assert all(v >= 0 for v in phases)
        assert abs(sum(phases) - step.wall) < 1e-9
        assert step.schedule > 0 and step.prepare > 0 and step.forward > 0 and step.sample > 0
        assert step.detokenize > 0 and step.bookkeeping > 0
    total = engine.step_timings
    assert total.steps == 12 and abs(total.wall - sum(s.wall for s in steps)) < 1e-9
    stats = engine.stats()
    assert stats["step_forward_s"] == total.forward and stats["step_wall_s"] == total.wall


def test_time_outside_the_named_phases_shows_as_other(tiny_model_dir):
    delay = 0.03  # the test-only step delay: part of no named phase
    engine = LLMEngine(tiny_model_dir, EngineArgs(num_kv_blocks=64, debug_step_delay_s=delay))
    steps = run_steps(engine)
    metrics = EngineMetrics("tiny", "r0")
    for step in steps:
        assert step.other >= delay, step
        metrics.observe_step(step)
    # ... and it is mostly the delay (the median: a step or two may lose the CPU on a busy machine).
    assert statistics.median(s.other - delay for s in steps) < delay
    # The histograms on /metrics: per phase, and the wall time they add up to.
    sums = {p: metrics.registry.get_sample_value("strata:engine_step_seconds_sum",
                                                 {"model_name": "tiny", "replica": "r0", "phase": p})
            for p in STEP_PHASES}
    wall = metrics.registry.get_sample_value("strata:engine_step_duration_seconds_sum",
                                             {"model_name": "tiny", "replica": "r0"})
    assert abs(sum(sums.values()) - wall) < 1e-6 and sums["other"] >= delay * len(steps)
    assert metrics.registry.get_sample_value("strata:engine_step_duration_seconds_count",
                                             {"model_name": "tiny", "replica": "r0"}) == len(steps)
