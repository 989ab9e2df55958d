"""The pieces of speculative decoding that need no model: n-gram lookup, the adaptive cost model
against a simulated engine, and the speculative_config argument (engine flag, deployment spec)."""

import argparse
import random

import numpy as np
import pytest

from services.control.spec import SpecError, validate
from services.engine.config import EngineArgs
from services.engine.spec_decode.adaptive import AdaptivePolicy, Candidate, bucket, expected_tokens
from services.engine.spec_decode.config import SpeculativeConfig
from services.engine.spec_decode.decoder import explore_seqs
from services.engine.spec_decode.ngram import ngram_proposal


def test_ngram_proposal_takes_the_longest_then_latest_match():
    t = np.array([1, 2, 3, 4, 5, 9, 7, 2, 3, 6, 1, 2, 3])
    assert ngram_proposal(t, 1, 3, 2) == [4, 5]  # (1, 2, 3) occurred at the start
    assert ngram_proposal(t, 1, 2, 2) == [6, 1]  # longest is 2 tokens: (2, 3), latest occurrence wins
    assert ngram_proposal(t, 4, 4, 2) == []  # no 4-token match
    assert ngram_proposal(np.array([5, 6, 7, 5, 6]), 2, 3, 9) == [7, 5, 6]  # as much as follows
    assert ngram_proposal(np.array([5]), 1, 3, 4) == [] and ngram_proposal(t, 1, 3, 0) == []


def test_expected_tokens_and_buckets():
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 33, 64)] == [1, 2, 3, 4, 6, 6, 8, 11, 16, 32, 32, 64]


def simulate(policy: AdaptivePolicy, batch: int, acceptance: float, base: float, extra: dict[int, float],
             steps: int, seed: int = 0) -> tuple[float, dict[int, int]]:
    """Run `steps` decode steps of `batch` sequences against a simulated cost (seconds per step:
    batch * base + speculating * extra[k], 3% noise; extra[k] may be a function of the number
    speculating) and acceptance; tokens per second, and how often each k was chosen."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(steps):
        k = policy.choose(batch, [Candidate(policy.acceptance(None), 4)] * batch)
        speculating = 0 if k == 0 else (min(batch, explore_seqs(batch)) if policy.exploring else batch)
        cost = extra.get(k, 0.0)  # seconds per speculating sequence, or a function of how many speculate
        per_seq = cost(speculating) if callable(cost) else cost
        t = (batch * base + speculating * per_seq) * (1 + rng.uniform(-0.03, 0.03))
        policy.observe(batch, k, speculating, t)
        seconds += t
        tokens += batch
        for _ in range(speculating):
            a = 0
            while a < k and rng.random() < acceptance:
                a += 1
            policy.engine_acceptance.add(a, k, policy.global_decay)
            tokens += a
    return tokens / seconds, dict(policy.chosen)


def test_the_policy_speculates_where_it_pays():
    """Batch 1, drafts accepted 80% of the time, a draft costing 10% of a step: the longest k."""
    plain = 1.0 / 0.010
    rate, chosen = simulate(AdaptivePolicy(4), 1, 0.8, base=0.010, extra={1: 0.002, 2: 0.003, 4: 0.005},
                            steps=2000)
    assert chosen[4] > 0.95 * 2000
    assert rate > 2.0 * plain  # (1 + .8 + .64 + .51 + .41) tokens for 1.5 steps: 2.24x


def test_the_policy_turns_speculation_off_where_it_costs_and_loses_under_five_percent():
    """Batch 32, verification costing more than it saves (each speculating sequence adds as much
    as two decodes): off after exploring, under 5% of throughput lost over a short run."""
    base = 0.004
    rate, chosen = simulate(AdaptivePolicy(4), 32, 0.5, base=base, extra={1: 2 * base, 2: 2.5 * base, 4: 3 * base},
                            steps=300)
    assert rate > 0.95 * (1 / base)
    assert chosen[0] > 290
    # ... and the same policy in the same engine still speculates when the batch is small.
    policy = AdaptivePolicy(4)
    simulate(policy, 32, 0.5, base=base, extra={1: 2 * base, 2: 2.5 * base, 4: 3 * base}, steps=300)
    simulate(policy, 1, 0.8, base=0.010, extra={1: 0.002, 2: 0.003, 4: 0.005}, steps=300)
    assert policy.chosen[4] > 250


def test_a_cost_that_grows_with_the_speculating_sequences_is_learnt_in_one_step_per_arm():
    """Batch 32, drafts accepted 90% of the time, each speculating sequence costing more the more
    of them speculate (compute-bound verification): a quarter of the batch (the exploring step)
    wins, all of it loses. The cost is keyed on how many speculate, so each arm is tried at the
    full batch once, found to lose, and left off: under 3% lost."""
    base = 0.004
    grows = {1: lambda s: 0.0002 * s, 2: lambda s: 0.0003 * s, 4: lambda s: 0.0005 * s}
    rate, chosen = simulate(AdaptivePolicy(4), 32, 0.9, base=base, extra=grows, steps=300)
    assert sum(n for k, n in chosen.items() if k) <= 2 * 3, chosen  # each arm: explored, then tried once
    assert rate > 0.97 * (1 / base)


def test_a_draft_models_catch_up_is_priced_by_the_share_of_the_output_a_step_yields():
    """A draft model 265 tokens behind every sequence (a prompt it has not seen), 0.1 ms per
    catch-up token, verification costing 0.6 of a decode per draft (compute-bound at batch 32).
    At batch 32 with 96 tokens left each, k=2 gains 20% without the catch-up and loses with its
    share: off. At batch 1 with 256 tokens left, the share is small: the longest k."""
    policy = AdaptivePolicy(4)
    for batch, base in ((32, 0.0005), (1, 0.003)):
        for _ in range(2):
            policy.observe(batch, 0, 0, batch * base)
        for k in policy.arms:
            policy.observe(batch, k, batch, batch * (base + 0.0003 * k))
    policy.observe_catch_up(265 * 8, 265 * 8 * 0.0001)
    caught_up, behind = Candidate(0.9, 4, 0, 96), Candidate(0.9, 4, 265, 96)
    assert policy.choose(32, [caught_up] * 32) > 0
    assert policy.choose(32, [behind] * 32) == 0
    assert policy.choose(1, [Candidate(0.9, 4, 265, 256)]) == 4


def test_low_acceptance_turns_speculation_off_even_at_batch_one():
    rate, chosen = simulate(AdaptivePolicy(4), 1, 0.02, base=0.010, extra={1: 0.002, 2: 0.003, 4: 0.005},
                            steps=1000)
    assert chosen[0] > 950 and rate > 0.97 * 100


def test_a_fixed_policy_always_takes_k():
    policy = AdaptivePolicy(3, adaptive=False)
    assert [policy.choose(b, [Candidate(0.0, 3)]) for b in (1, 64)] == [3, 3]
    assert policy.choose(8, []) == 0  # nobody to speculate for


def test_speculative_config_in_vllm_shape():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.adaptive) == \
        ("ngram", 5, 4, 4, True)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max == 5
    for bad, word in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                        "prompt_lookup_max": 3}, "prompt_lookup_min"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
                      ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                      ({"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2}, "model"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive")]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram"})


def test_the_engine_flag_and_the_deployment_spec_carry_it(tiny_model_dir):
    config = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flags = EngineArgs.cli_flags({"speculative_config": config})
    args = EngineArgs.from_cli_args(parser.parse_args(flags))
    assert args.speculative_config == config and args.speculative.model == str(tiny_model_dir)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])
    spec = {"name": "d", "model": str(tiny_model_dir), "engine": {"speculative_config": {
        "method": "draft_model", "model": "/on/the/engine/host", "num_speculative_tokens": 2}}}
    assert validate(spec, check_model=False).engine["speculative_config"]["num_speculative_tokens"] == 2
    for value, reason in [({"method": "ngram"}, "num_speculative_tokens"), ("ngram", "a mapping")]:
        with pytest.raises(SpecError, match=reason):
            validate({**spec, "engine": {"speculative_config": value}}, check_model=False)
