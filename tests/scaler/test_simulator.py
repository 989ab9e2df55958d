"""The fleet simulator: small fast runs (tens of replicas, an hour) and hand-computed traces."""

import json

import numpy as np
import pytest

from services.scaler import simulator, traces
from services.scaler.policy import ScalingConfig
from services.scaler.simulator import Experiment, FleetSim, ReplicaModel, ScheduleScaler
from services.scheduler.policy import Router


def tiny_trace(rows, duration=10.0):
    arr = np.array(rows, dtype=np.float64)
    return traces.Trace("tiny", arr[:, 0], arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64), duration)


def fixed_run(trace, model, replicas=1, slo=2.0):
    sim = FleetSim(trace, model, ScheduleScaler(np.array([replicas]), 1.0, "fixed"), slo_ttft_s=slo,
                   tick_s=1.0, initial_replicas=replicas)
    return sim.run()


def test_attainment_and_waits_on_a_hand_made_trace():
    # One replica, one sequence at a time: prefill 500 tokens = 0.5s, decode 10 tokens = 1s.
    model = ReplicaModel(prefill_tokens_per_s=1000, decode_tokens_per_s=10, max_num_seqs=1, cold_start_s=0)
    trace = tiny_trace([(0.0, 500, 10), (0.1, 500, 10), (0.2, 500, 10)])
    result = fixed_run(trace, model)
    # r0 runs 0-1.5 (first token 0.5). r1 is routed (a replica takes one beyond a full batch)
    # and waits in the engine until 1.5: first token 2.0, done 3.0. r2 finds the replica
    # saturated and waits in the admission queue; at 1.5 it moves to the engine, starts at 3.0.
    assert np.allclose(result.ttft_s, [0.5, 1.9, 3.3])
    assert result.metrics["slo_attainment"] == pytest.approx(2 / 3)
    assert result.metrics["queue_wait_s"]["p50"] == pytest.approx(1.4)
    assert result.metrics["completed"] == 3
    assert result.metrics["replica_hours"] == pytest.approx(10 / 3600)  # one replica, the 10s trace


def test_prefills_on_one_replica_run_one_after_another():
    model = ReplicaModel(prefill_tokens_per_s=1000, decode_tokens_per_s=10, max_num_seqs=4, cold_start_s=0)
    result = fixed_run(tiny_trace([(0.0, 1000, 10), (0.0, 1000, 10), (0.5, 500, 10)]), model, slo=1.5)
    assert np.allclose(result.ttft_s, [1.0, 2.0, 2.0])  # the third starts when the second's prefill ends
    assert result.metrics["slo_attainment"] == pytest.approx(1 / 3)


def test_kv_capacity_holds_requests_in_the_engine():
    # 256 blocks of KV: a 3000-token request holds 188, a 1200-token one needs 75 more.
    model = ReplicaModel(prefill_tokens_per_s=1000, decode_tokens_per_s=100, max_num_seqs=8,
                         kv_capacity_tokens=4096, cold_start_s=0)
    result = fixed_run(tiny_trace([(0.0, 2000, 1000), (0.0, 100, 1100)]), model)
    assert np.allclose(result.ttft_s, [2.0, 12.1])  # the second starts when the first ends (12s)


def small_experiment(kind="bursty", replicas=50, duration=3600.0, seed=1):
    model = ReplicaModel()
    sizes = traces.RequestSizes()
    cfg = ScalingConfig(min_replicas=1, max_replicas=replicas, cold_start_s=model.cold_start_s)
    rate = 0.9 * replicas * model.requests_per_s(sizes, cfg.target_concurrency)
    return Experiment(traces.generate(kind, rate, duration, seed, sizes), model, cfg, seed=seed)


@pytest.mark.parametrize("kind", ["steady", "bursty"])
def test_small_fleet_every_request_ends_and_the_policy_costs_less_than_fixed(kind):
    experiment = small_experiment(kind)
    results = simulator.run_all(experiment)
    n = len(experiment.trace)
    for r in results.values():
        assert r.metrics["requests"] == r.metrics["completed"] == n
        assert np.all(r.ttft_s > 0)
        ready_or_starting = r.timeline["ready"] + r.timeline["starting"]
        assert ready_or_starting.max() <= 50 and ready_or_starting[1:].min() >= 1
    assert results["policy"].metrics["replica_hours"] <= results["fixed"].metrics["replica_hours"]
    assert results["oracle"].metrics["replica_hours"] <= results["fixed"].metrics["replica_hours"]
    assert results["oracle"].metrics["slo_attainment"] >= 0.99
    assert results["policy"].metrics["slo_attainment"] >= 0.95


def test_a_seed_gives_the_same_figures():
    first, second = (small_experiment("bursty", replicas=20, duration=1800.0).run("policy") for _ in range(2))
    first.metrics.pop("wall_s"), second.metrics.pop("wall_s")
    assert first.metrics == second.metrics
    assert np.array_equal(first.timeline["ready"], second.timeline["ready"])


def test_the_oracle_covers_the_load_within_bounds():
    load = np.array([0, 40, 40, 200, 900, 50, 0, 0, 0, 0], dtype=np.int64)
    cfg = ScalingConfig(min_replicas=1, max_replicas=40, target_concurrency=16)
    counts = simulator.oracle_counts(load, cfg, cold_start_s=2.0, tick_s=1.0)
    # Each tick holds what the load needs until a replica started a tick later is ready
    # (cold start 2s + one tick: this bin and the next three), clamped to [1, 40].
    assert counts.tolist() == [13, 40, 40, 40, 40, 4, 1, 1, 1, 1]
    need = np.minimum(np.ceil(load / 16), 40)
    assert np.all(counts >= need) and counts.min() >= 1 and counts.max() <= 40
    assert simulator.fixed_count(load, cfg) == 40


def test_ideal_concurrency_counts_requests_in_flight_per_bin():
    model = ReplicaModel(prefill_tokens_per_s=1000, decode_tokens_per_s=10)
    # Services: 0.5 + 1 = 1.5s each; in flight [0, 1.5), [1, 2.5), [4, 5.5).
    trace = tiny_trace([(0.0, 500, 10), (1.0, 500, 10), (4.0, 500, 10)], duration=6.0)
    assert simulator.ideal_concurrency(trace, model, 1.0).tolist() == [1, 2, 1, 0, 1, 1, 0]


def test_routing_goes_through_the_schedulers_router(monkeypatch):
    calls = []
    least_loaded = Router.least_loaded  # rank("least_load")'s head (tests/scheduler/test_policy.py)

    def counting(self, candidates):
        calls.append(len(candidates))
        return least_loaded(self, candidates)

    monkeypatch.setattr(Router, "least_loaded", counting)
    experiment = small_experiment("steady", replicas=20, duration=600.0)
    experiment.run("fixed")
    assert len(calls) == len(experiment.trace)  # every request routed once, on a sample of two
    assert set(calls) == {2}


def test_generators_are_seeded_and_bursty_reaches_its_peak():
    a = traces.generate("bursty", 10.0, 7200, seed=3)
    b = traces.generate("bursty", 10.0, 7200, seed=3)
    c = traces.generate("bursty", 10.0, 7200, seed=4)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.output_tokens, b.output_tokens)
    assert not np.array_equal(a.arrival_s[:100], c.arrival_s[:100])
    rate = traces.bursty_rate(10.0, 7200, np.random.default_rng(3))
    assert rate.min() == pytest.approx(2.0) and rate.max() == pytest.approx(10.0)
    diurnal = traces.diurnal_rate(10.0, traces.DAY_S)
    assert diurnal[0] == pytest.approx(2.0) and diurnal[43200] == pytest.approx(10.0)
    assert np.all(np.diff(a.arrival_s) >= 0) and np.all(a.arrival_s < 7200)


def test_trace_files_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival_s,prompt_tokens,output_tokens\n2.5,100,20\n0.5,50,10\n")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"arrival_s": 0.5, "prompt_tokens": 50, "output_tokens": 10}\n'
                     '{"arrival_s": 2.5, "prompt_tokens": 100, "output_tokens": 20}\n')
    for path in (csv_path, jsonl):
        trace = traces.load(path)
        assert trace.arrival_s.tolist() == [0.5, 2.5] and trace.prompt_tokens.tolist() == [50, 100]
        assert trace.output_tokens.tolist() == [10, 20] and trace.duration_s == 3.0
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens\n1,2\n")
    with pytest.raises(ValueError, match="record 1 needs arrival_s, prompt_tokens, output_tokens"):
        traces.load(bad)


def test_cli_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "out"
    assert simulator.main(["bursty", "--replicas-max", "30", "--duration", "1800", "--seed", "2",
                           "--out", str(out)]) == 0
    report = json.loads((out / "simulate.json").read_text())
    assert set(report["scenarios"]) == {"policy", "oracle", "fixed"}
    assert report["trace"]["requests"] == report["scenarios"]["policy"]["completed"]
    assert report["policy_vs_oracle_replica_hours"] > 0
    timeline = report["timeline_per_minute"]
    assert len(timeline["t"]) == len(timeline["policy"]) == len(timeline["load_replicas"]) == 31
    assert (out / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "replica-hours" in printed and "TTFT <= 2s" in printed


def test_cli_reads_a_trace_file_and_rejects_bad_input(tmp_path, capsys):
    path = tmp_path / "trace.csv"
    rows = "\n".join(f"{i * 0.5},{200},{40}" for i in range(120))
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + rows + "\n")
    assert simulator.main([str(path), "--replicas-max", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"]["requests"] == 120 and report["trace"]["duration_s"] == 60.0
    assert report["scenarios"]["fixed"]["slo_attainment"] == 1.0
    assert simulator.main([str(tmp_path / "missing.csv")]) == 2
    assert simulator.main(["steady", "--scenarios", "policy,magic"]) == 2
    assert simulator.main(["steady", "--replicas-max", "0"]) == 2
    assert simulator.main(["steady", "--decode-tps", "0"]) == 2
    assert simulator.main(["steady", "--route-choices", "0"]) == 2
    assert "decode_tokens_per_s must be positive" in capsys.readouterr().err
