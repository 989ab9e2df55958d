"""The decode window of bench/engine_realistic.py's decode points (bench/runner_protocol.py's StepClock):
the steps in which every request of the batch decodes, found from each step's end time and token
count, with the prefill outside it however many steps that takes."""

import pytest

from bench.engine_realistic_runners import HfRunner, StrataRunner
from bench.runner_protocol import StepClock

MODES = {"greedy": {"temperature": 0.0}}


def clock_of(steps: list[tuple[float, int]], batch: int) -> StepClock:
    clock = StepClock(batch)
    clock.steps = list(steps)
    return clock


def test_window_starts_after_the_last_first_token_and_ends_at_the_last_full_step():
    # 4 requests: a chunked prefill gives two of them their first token at 2.0, the other two at 3.0
    # (beside the first two's second tokens); the first two finish one step before the others.
    steps = [(1.0, 0), (2.0, 2), (3.0, 4), (4.0, 4), (5.5, 4), (6.0, 2)]
    clock = clock_of(steps, 4)
    assert clock.window() == (2, 4)
    assert clock.figures() == {"decode_s": 2.5, "decode_tokens": 8, "decode_steps": 2}


def test_no_window_without_two_full_steps():
    with pytest.raises(RuntimeError, match="no decode window: 1 of 2 steps gave all 3 requests a token; "
                                           "give them more output tokens"):
        clock_of([(1.0, 3), (2.0, 1)], 3).window()


def test_steps_from_per_request_token_stamps():
    # Three requests in lockstep, 10 ms steps, stamped a few microseconds apart within a step; the
    # third starts one step late.
    starts = {0: 0, 1: 0, 2: 1}
    stamps = [[0.010 * (starts[r] + k + 1) + 2e-6 * r for k in range(5)] for r in range(3)]
    clock = StepClock(3)
    clock.record_requests(stamps)
    assert [tokens for _, tokens in clock.steps] == [2, 3, 3, 3, 3, 1]
    assert clock.figures() == pytest.approx({"decode_s": 0.030, "decode_tokens": 9, "decode_steps": 3}, abs=1e-5)


def _job(model: str, workload: dict) -> dict:
    return {"model": model, "threads": 1, "dtype": "float32", "kv_cache_gib": 1, "sampler_backend": "auto",
            "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "modes": MODES,
            "workloads": [workload], "warmup": {"prompts": [[5, 6, 7]], "max_tokens": [2]},
            "run_timeout_s": 120, "device": "cpu"}


def _decode_workload(batch: int, prompt_len: int, max_tokens: int) -> dict:
    prompts = [[(7 * r + i) % 200 + 10 for i in range(prompt_len)] for r in range(batch)]
    return {"name": f"decode-b{batch}", "prompts": prompts, "max_tokens": [max_tokens] * batch,
            "decode_batch": batch}


def test_strata_runner_times_the_decode_steps_of_a_chunked_prefill(tiny_model_dir):
    # 4 prompts of 40 tokens with 64 tokens a step: the prefill takes three steps, and the requests
    # get their first tokens in different ones.
    workload = _decode_workload(4, 40, 10)
    runner = StrataRunner(_job(str(tiny_model_dir), workload))
    generate, account = runner.prepare(workload, "greedy")
    answer = account(generate())
    assert "step" not in vars(runner.llm.engine)  # the clock is off again
    assert answer["output_tokens"] == 40
    # Every full step gives all 4 requests a token; the window holds at least the steps after the
    # last first token, less the steps the early starters finish ahead.
    assert answer["decode_tokens"] == 4 * answer["decode_steps"]
    assert 6 <= answer["decode_steps"] <= 9
    phases = answer["decode_phases_s"]
    assert 0 < phases["wall"] <= answer["decode_s"]
    assert phases["forward"] > 0 and phases["forward"] < phases["wall"]


def test_hf_static_runner_times_every_step_after_the_first_token(tiny_model_dir):
    workload = _decode_workload(3, 12, 6)
    runner = HfRunner("hf-static", _job(str(tiny_model_dir), workload))
    generate, account = runner.prepare(workload, "greedy")
    answer = account(generate())
    assert answer["output_tokens"] == 18
    assert answer["decode_steps"] == 5 and answer["decode_tokens"] == 15 and answer["decode_s"] > 0
