"""`strata diagnose`'s analysis on crafted figures: each kind of trouble is named at its layer."""

import json

from services.control.diagnose import (DeploymentFigures, EngineFigures, Figures, ServiceFigures, Thresholds,
                                       diagnose, render)

WINDOW = 60.0


def engine(replica_id: str, requests=50, concurrency=1.0, itl=0.02, hit=0.6, revision="", errors=0, running=1,
           max_num_seqs=64, phases=None) -> EngineFigures:
    """One replica's window: `concurrency` requests in flight on average (Little's law)."""
    tokens = requests * 20
    phases = phases or {"forward": 12.0, "sample": 2.0, "schedule": 1.0, "prepare": 1.0, "detokenize": 0.5,
                        "bookkeeping": 0.5, "other": 1.0}
    return EngineFigures(replica_id, "chat", revision=revision, window_s=WINDOW, running=running,
                         max_num_seqs=max_num_seqs, kv_usage=0.3, requests=requests, errors=errors,
                         busy_s=concurrency * WINDOW, itl_sum=itl * tokens, itl_count=tokens, prefix_queries=10_000,
                         prefix_hits=hit * 10_000, steps=1000, step_phases=phases)


def deployment(replicas, requests=100, ttft=0.1, e2e=0.5, admission=0.0, engine_queue=0.0, policy="kv_aware",
               reachable=0.6, matched=0.58, settings=None) -> DeploymentFigures:
    prefill = ttft - admission - engine_queue - 0.01
    layers = {"gateway": 0.002, "admission_wait": admission, "routing": 0.001, "bus": 0.007,
              "engine_queue": engine_queue, "engine_prefill": prefill, "engine_decode": e2e - ttft}
    return DeploymentFigures("chat", requests=requests, ttft_sum=ttft * requests, e2e_sum=e2e * requests,
                             layers={k: v * requests for k, v in layers.items()}, policy=policy,
                             queued=requests if admission else 0, queue_wait_sum=admission * requests,
                             matched_sum=matched * requests, reachable_sum=reachable * requests, lookups=requests,
                             settings=settings or {}, replicas=replicas)


def figures(*deployments) -> Figures:
    return Figures(WINDOW, list(deployments), [ServiceFigures("gateway", "gw-0", "http://gw", True),
                                              ServiceFigures("scheduler", "s-0", "http://s", True, "queue 0")])


def test_a_healthy_fleet_has_no_verdict():
    report = diagnose(figures(deployment([engine("e0"), engine("e1")])))
    assert report.findings == [] and report.verdict is None
    text = render(report)
    assert "verdict: no layer stands out" in text and "runtime 9" in text  # decode is most of the time
    assert "engine e0 (chat) ready" in text and "gateway gw-0 http://gw: up" in text


def test_too_few_replicas_is_infrastructure_admission():
    saturated = [engine(f"e{i}", concurrency=64, running=64) for i in range(2)]
    d = deployment(saturated, ttft=1.0, admission=0.78, settings={"max_replicas": "2"})
    verdict = diagnose(figures(d)).verdict
    assert (verdict.layer, verdict.area) == ("infrastructure", "admission")
    assert verdict.summary == ("78% of TTFT is admission wait; all 2 replicas were saturated and the deployment "
                               "is at max replicas")
    assert verdict.fix == "raise max_replicas (now 2)"
    d.settings = {}
    assert diagnose(figures(d)).verdict.fix.startswith("add replicas")


def test_shared_prefixes_spread_by_round_robin_is_infrastructure_routing():
    d = deployment([engine("e0", hit=0.08), engine("e1", hit=0.08)], policy="round_robin", reachable=0.85,
                   matched=0.1)
    verdict = diagnose(figures(d)).verdict
    assert (verdict.layer, verdict.area) == ("infrastructure", "routing")
    assert verdict.summary == ("requests sharing prefixes are spread across replicas (hit rate 8% where 85% is "
                               "reachable)")
    assert "use kv_aware" in verdict.fix
    # The same hit rate where little is reachable is no routing problem.
    assert diagnose(figures(deployment([engine("e0", hit=0.08)], reachable=0.1))).verdict is None


def test_slow_tokens_at_low_concurrency_is_the_runtime():
    slow = engine("e0", itl=0.11, concurrency=1.0, phases={"forward": 1.5, "other": 95.0, "sample": 0.5})
    verdict = diagnose(figures(deployment([slow], e2e=2.3))).verdict
    assert (verdict.layer, verdict.area) == ("runtime", "engine")
    assert verdict.summary == ("inter-token latency 110 ms at low concurrency (1.0 per replica): the engine is slow, "
                               "not the fleet")
    assert any(e.startswith("step 97 ms: other 98%") for e in verdict.evidence)
    assert "outside every named phase" in verdict.fix


def test_slow_tokens_with_full_batches_is_capacity():
    busy = engine("e0", itl=0.11, concurrency=60, running=64)
    verdict = diagnose(figures(deployment([busy], e2e=2.3))).verdict
    assert (verdict.layer, verdict.area) == ("infrastructure", "capacity")


def test_a_bad_canary_revision_is_tooling_and_outranks_the_rest():
    replicas = [engine("e0", requests=35, revision="6", errors=1), engine("e1", requests=35, revision="6", errors=1),
                engine("e2", requests=30, revision="7", errors=10, concurrency=64, running=64)]
    d = deployment(replicas, ttft=1.0, admission=0.6)  # the queue builds up too
    report = diagnose(figures(d))
    assert [f.area for f in report.findings] == ["revision", "admission"]
    verdict = report.verdict
    assert verdict.layer == "tooling"
    assert verdict.summary == "revision 7 serves 30% of traffic with 12x the errors of revision 6"
    assert verdict.fix == "roll back revision 7"
    assert "revisions serving: 6, 7" in "\n".join(report.state["tooling"])


def test_a_slow_revision_is_tooling_too():
    replicas = [engine("e0", requests=50, revision="6", concurrency=0.5),
                engine("e1", requests=50, revision="7", concurrency=2.0)]
    verdict = diagnose(figures(deployment(replicas))).verdict
    assert verdict.layer == "tooling" and verdict.summary == (
        "revision 7 serves 50% of traffic 4.0x slower than revision 6")


def test_too_little_traffic_says_nothing():
    saturated = [engine("e0", requests=2, concurrency=64, running=64)]
    d = deployment(saturated, requests=3, ttft=1.0, admission=0.9)
    assert diagnose(figures(d)).findings == []
    assert diagnose(figures(d), Thresholds(min_requests=2)).verdict.area == "admission"


def test_the_report_is_json():
    report = diagnose(figures(deployment([engine("e0", itl=0.2)])))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["verdict"]["layer"] == "runtime" and set(data["state"]) == {"runtime", "infrastructure", "tooling"}
    assert abs(sum(data["split"]["chat"].values()) - 1) < 1e-9


def test_a_cold_start_is_not_called_saturation():
    """Requests waited in the admission queue because the only replica was starting (scaled from
    zero): it started 20 s into the 60 s window, and its engine counts 500 of the 550 s the
    requests waited as spent before it was ready."""
    young = engine("e0", requests=20, concurrency=0.8, running=1)
    young.window_s, young.cold_start_wait_s = 40.0, 500.0
    d = deployment([young], ttft=6.0, admission=5.5, settings={"min_replicas": "0", "max_replicas": "2"})
    d.window_s = WINDOW
    verdict = diagnose(figures(d)).verdict
    assert (verdict.layer, verdict.area) == ("infrastructure", "cold start")
    assert "saturat" not in verdict.summary.replace("not saturation", "")
    assert verdict.summary == ("92% of TTFT is admission wait while replicas started: a cold start, not saturation "
                               "(no replica was up when the window began)")
    evidence = "\n".join(verdict.evidence)
    assert "91% of it before a replica was ready" in evidence and "e0 20 s into the window" in evidence
    assert "replicas.min 0" in verdict.fix
    # A replica that started in the window too, but the requests came once it was ready and
    # queued because it was full: saturation.
    young.cold_start_wait_s = 0.0
    verdict = diagnose(figures(d)).verdict
    assert verdict.area == "admission" and "was saturated" in verdict.summary
    # The cold start's wait with a replica that was up all along and full is saturation too.
    young.cold_start_wait_s = 500.0
    full = engine("e1", concurrency=64, running=64)
    full.window_s = WINDOW
    d.replicas = [young, full]
    verdict = diagnose(figures(d)).verdict
    assert verdict.area == "admission" and "were saturated" in verdict.summary


def test_an_automatic_rollback_is_a_tooling_event():
    d = deployment([engine("e0", revision="1")])
    d.now = 1000.0
    d.events = [{"at": 960.0, "action": "rollback", "actor": "canary-analysis", "stable": 1, "canary": 0,
                 "analysis": {"decision": "fail", "step": 25, "canary_revision": 2, "stable_revision": 1,
                              "canary_requests": 52, "stable_requests": 160, "window_s": 14.2,
                              "reason": "TTFT p90 410 ms vs stable 90 ms (4.56x, limit 1.5x; rank test p=1e-12, "
                                        "alpha 0.0056)",
                              "checks": [{"name": "ttft_p90", "failed": True, "detail": "TTFT p90 410 ms ..."},
                                         {"name": "error_rate", "failed": False, "detail": "error rate 0.0% ..."}]}}]
    report = diagnose(figures(d))
    verdict = report.verdict
    assert (verdict.layer, verdict.area) == ("tooling", "canary rollback")
    assert verdict.summary == ("the canary analysis rolled revision 2 back 40 s ago at 25% of traffic: it was worse "
                               "than revision 1")
    assert verdict.evidence[0].startswith("TTFT p90 410 ms vs stable 90 ms")
    assert "traffic is back on revision 1" in verdict.evidence[-1]
    assert "strata history chat" in verdict.fix
    # A rollback by hand is the operator's own doing: no finding.
    d.events[0]["actor"] = "local-dev"
    assert diagnose(figures(d)).verdict is None
