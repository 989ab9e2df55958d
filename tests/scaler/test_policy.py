"""The scaling policy on crafted signal sequences: pure logic, exact replica counts."""

import pytest

from services.scaler.policy import ScaleDecision, ScalerPolicy, ScalingConfig, Signals

TICK = 2.0


def feed(policy: ScalerPolicy, start: float, end: float, **signals) -> list[tuple[float, ScaleDecision]]:
    """One decision every TICK seconds in [start, end) on the same signals."""
    out = []
    t = start
    while t < end - 1e-9:
        out.append((t, policy.decide(Signals(now=t, **{"waiting": 0, "queue_depth": 0, "starting": 0, **signals}))))
        t += TICK
    return out


def at(decisions, t: float) -> ScaleDecision:
    return next(d for when, d in decisions if abs(when - t) < 1e-9)


def test_scales_up_on_a_queue_and_counts_starting_replicas_as_capacity_coming():
    policy = ScalerPolicy(ScalingConfig(max_replicas=20))
    # Two replicas are saturated (KV-bound at 10 requests each) and 40 requests have waited 1s:
    # each needs capacity that does not exist, 40 / 16 -> 3 more replicas.
    d = policy.decide(Signals(now=0.0, ready=2, starting=0, running=20, waiting=0, queue_depth=40, oldest_wait_s=1.0))
    assert (d.desired, d.reason) == (5, "queue 40 > capacity")
    # Three replicas on their way take up to 48 of the queue: no further batch for the same queue.
    d = policy.decide(Signals(now=2.0, ready=2, starting=3, running=20, waiting=0, queue_depth=40, oldest_wait_s=3.0))
    assert d.desired == 5
    # The queue grew past what is coming: one more.
    d = policy.decide(Signals(now=4.0, ready=2, starting=3, running=20, waiting=0, queue_depth=60, oldest_wait_s=5.0))
    assert (d.desired, d.reason) == (6, "queue 60 > capacity")


def test_a_fresh_queue_is_not_yet_a_reason_to_scale():
    policy = ScalerPolicy(ScalingConfig(max_replicas=20))
    d = policy.decide(Signals(now=0.0, ready=2, starting=0, running=20, waiting=0, queue_depth=4, oldest_wait_s=0.1))
    assert d.desired == 2  # ceil(24 / 16); the queue is younger than a quarter of the SLO


def test_holds_during_the_stable_window_and_scales_down_only_after_the_cooldown():
    cfg = ScalingConfig(min_replicas=1, max_replicas=20, target_concurrency=16, stable_window_s=60,
                        scale_down_delay_s=30)
    policy = ScalerPolicy(cfg)
    busy = feed(policy, 0, 120, ready=10, running=160)
    assert {d.desired for _, d in busy} == {10}
    idle = feed(policy, 120, 260, ready=10, running=0)
    # j ticks after the first idle sample (t=120), the stable mean is 160 * (29 - j) / 30, i.e.
    # ceil((29 - j) / 3) replicas; a lower want is honoured only once it is the max over 30s.
    for t in range(120, 154, 2):
        assert at(idle, t).desired == 10, t
    assert at(idle, 154).desired == 9  # the want of t=124 (j=2); t=122's 10 is now over 30s old
    assert at(idle, 154).reason == "cooldown: hold 9 (want 4)"
    assert at(idle, 180).desired == 5  # the want of t=150: ceil(14 / 3)
    assert at(idle, 210).desired == 1  # the window is empty: min_replicas
    assert at(idle, 258).desired == 1  # min_replicas is 1: never to zero


def test_panic_on_a_burst_never_scales_down_until_a_stable_window_has_passed():
    cfg = ScalingConfig(max_replicas=50, target_concurrency=16, stable_window_s=60, panic_window_s=6,
                        scale_down_delay_s=30, cold_start_s=10)
    policy = ScalerPolicy(cfg)
    calm = feed(policy, 0, 60, ready=2, running=32)
    assert {(d.desired, d.panic) for _, d in calm} == {(2, False)}
    # 168 requests queue up at once: the panic window's mean is (32 + 32 + 200) / 3 = 88, 2.75x
    # what 2 replicas carry: panic. The rise over the window before (56 in 6s, far beyond count
    # noise) is projected a cold start ahead, capped at panic_threshold x 88 = 176 -> 11.
    d = policy.decide(Signals(now=60.0, ready=2, starting=0, running=32, waiting=0, queue_depth=168))
    assert (d.desired, d.panic, d.reason) == (11, True, "trend: +9.3/s, 176 in 10s")
    # A step looks like a ramp until the window before it is full of it too: the projection
    # goes on for a window (2 x 144 -> 18, then 2 x 200 -> 25) and panic holds the most.
    burst = feed(policy, 62, 70, ready=2, starting=10, running=32, queue_depth=168)
    assert [d.desired for _, d in burst] == [18, 25, 25, 25]
    assert all(d.panic for _, d in burst) and burst[-1][1].reason == "panic: hold 25 (want 19)"
    # The new replicas serve the burst, which ends at once. The 2x condition last held at t=68
    # (ready still 2), so panic, and its hold, last until t=128.
    after = feed(policy, 70, 200, ready=12, running=32)
    for t in range(70, 128, 2):
        assert at(after, t).panic and at(after, t).desired == 25, t
    # Then the ordinary cooldown: the most wanted in the last 30s, at t=98, whose stable window
    # still held the burst: (25 x 32 + 5 x 200) / 30 = 60 -> 4.
    assert (at(after, 128).desired, at(after, 128).panic) == (4, False)
    assert at(after, 160).desired == 2


def test_never_below_min_nor_above_max():
    policy = ScalerPolicy(ScalingConfig(min_replicas=2, max_replicas=4))
    d = policy.decide(Signals(now=0.0, ready=4, starting=0, running=1000, waiting=50, queue_depth=500,
                              oldest_wait_s=5.0))
    assert d.desired == 4 and d.reason.endswith("(at max 4)")
    decisions = feed(policy, 2, 400, ready=4, running=0)
    assert min(d.desired for _, d in decisions) == 2
    assert decisions[-1][1].desired == 2


def test_scales_to_zero_only_after_the_idle_period_and_only_when_min_is_zero():
    cfg = ScalingConfig(min_replicas=0, max_replicas=4, scale_to_zero_after_s=120)
    policy = ScalerPolicy(cfg)
    feed(policy, 0, 10, ready=1, running=3)  # last demand at t=8
    idle = feed(policy, 10, 140, ready=1, running=0)
    for t in range(10, 128, 2):
        assert at(idle, t).desired == 1, t
    assert at(idle, 126).reason == "idle 118s < 120s: keep 1"
    d = at(idle, 128)
    assert (d.desired, d.reason) == (0, "idle 120s: to zero")
    # min_replicas = 1 keeps one, however long the idle period.
    policy = ScalerPolicy(ScalingConfig(min_replicas=1, max_replicas=4))
    feed(policy, 0, 10, ready=1, running=3)
    assert {d.desired for _, d in feed(policy, 10, 600, ready=1, running=0)} == {1}


def test_from_zero_one_queued_request_starts_one_replica_at_once():
    policy = ScalerPolicy(ScalingConfig(min_replicas=0, max_replicas=4))
    assert policy.decide(Signals(now=0.0, ready=0, starting=0, running=0, waiting=0, queue_depth=0)).desired == 0
    d = policy.decide(Signals(now=2.0, ready=0, starting=0, running=0, waiting=0, queue_depth=1))
    assert (d.desired, d.reason) == (1, "queue 1 > capacity")
    # While it starts, the same request does not start another one.
    d = policy.decide(Signals(now=4.0, ready=0, starting=1, running=0, waiting=0, queue_depth=1, oldest_wait_s=2.0))
    assert d.desired == 1
    # More requests than one replica will carry: a second.
    d = policy.decide(Signals(now=6.0, ready=0, starting=1, running=0, waiting=0, queue_depth=20, oldest_wait_s=4.0))
    assert d.desired == 2


def test_kv_saturation_and_ttft_over_the_slo_add_a_step_unless_replicas_are_starting():
    policy = ScalerPolicy(ScalingConfig(max_replicas=40))
    d = policy.decide(Signals(now=0.0, ready=4, starting=0, running=40, waiting=0, queue_depth=0, kv_usage=0.95))
    assert (d.desired, d.reason) == (5, "saturated: kv 0.95")
    policy = ScalerPolicy(ScalingConfig(max_replicas=40))
    d = policy.decide(Signals(now=0.0, ready=20, starting=0, running=200, waiting=0, queue_depth=0, ttft_p90_s=3.0))
    assert (d.desired, d.reason) == (22, "ttft p90 3.0s > slo 2s")  # 10% of 20
    policy = ScalerPolicy(ScalingConfig(max_replicas=40))
    d = policy.decide(Signals(now=0.0, ready=20, starting=2, running=200, waiting=0, queue_depth=0, ttft_p90_s=3.0))
    assert d.desired == 22  # the fleet it found (20 + 2 starting); no new step


def test_steady_load_with_count_noise_does_not_trend():
    policy = ScalerPolicy(ScalingConfig(max_replicas=100, cold_start_s=30))
    wobble = [800, 830, 790, 760, 820, 850, 780, 800]  # ~ sqrt(800) = 28 either way
    decisions = [policy.decide(Signals(now=2.0 * i, ready=50, starting=0, running=wobble[i % len(wobble)],
                                       waiting=0, queue_depth=0)) for i in range(60)]
    assert max(d.desired for d in decisions) == 52  # the largest 6s mean, 817 -> 52: no look-ahead
    assert not any(d.reason.startswith("trend") for d in decisions)


def test_update_config_keeps_the_history():
    policy = ScalerPolicy(ScalingConfig(max_replicas=20))
    feed(policy, 0, 60, ready=10, running=160)
    policy.update_config(ScalingConfig(max_replicas=5))
    assert policy.decide(Signals(now=60.0, ready=10, starting=0, running=160, waiting=0, queue_depth=0)).desired == 5
    policy.update_config(ScalingConfig(max_replicas=20))
    assert policy.decide(Signals(now=62.0, ready=5, starting=0, running=80, waiting=0, queue_depth=0)).desired == 10


@pytest.mark.parametrize("kwargs, field", [
    ({"min_replicas": 5, "max_replicas": 2}, "min_replicas"),
    ({"min_replicas": -1}, "min_replicas"),
    ({"min_replicas": 1.5}, "min_replicas"),
    ({"max_replicas": 0, "min_replicas": 0}, "max_replicas"),
    ({"target_concurrency": 0}, "target_concurrency"),
    ({"ttft_slo_s": -2}, "ttft_slo_s"),
    ({"panic_window_s": 120}, "panic_window_s"),
    ({"panic_threshold": 1.0}, "panic_threshold"),
    ({"scale_down_delay_s": -1}, "scale_down_delay_s"),
    ({"cold_start_s": "ten"}, "cold_start_s"),
    ({"kv_high": 1.5}, "kv_high"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ScalingConfig(**kwargs)
