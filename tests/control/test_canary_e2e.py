"""Deploy, canary, roll back: traffic splits as asked and no request fails at any step."""

import concurrent.futures
import json
import subprocess
import sys
import threading
import time

import pytest
from openai import OpenAI

from services.control.client import ControlError

pytestmark = pytest.mark.slow


def spec(model_dir, **extra):
    return {"name": "canary-demo", "model": str(model_dir), "aliases": ["canary-alias"],
            "replicas": {"min": 1, "max": 1}, "engine": {"max_num_seqs": 16}, **extra}


class Traffic:
    """Requests in a loop from a few threads, recording which revision served each."""

    def __init__(self, client: OpenAI, model: str, threads: int = 4):
        self.client, self.model = client, model
        self.served: list[int | None] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.one()

    def one(self) -> int | None:
        try:
            r = self.client.completions.create(model=self.model, prompt="The canary says", max_tokens=2,
                                               timeout=30)
            revision = r.model_extra["strata"]["revision"]
            self.served.append(revision)
            return revision
        except Exception as exc:  # recorded: the test asserts there were none
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return None

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=60)
        self._pool.shutdown()


def test_deploy_canary_rollback_without_failures(managed_stack, tiny_model_dir):
    stack, control = managed_stack, managed_stack.client
    try:
        check_canary_and_rollback(stack, control, tiny_model_dir)
    finally:  # the stack is shared: leave no deployment (and no engines) behind
        control.delete("canary-demo")


def check_canary_and_rollback(stack, control, tiny_model_dir):
    r1 = stack.deploy(spec(tiny_model_dir))
    assert r1["revision"] == 1
    stack.wait_replicas("canary-demo", 1, revision=1)
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    deadline = time.monotonic() + 20  # the gateway learns the new name from control's announcement
    while time.monotonic() < deadline and "canary-alias" not in [m.id for m in client.models.list()]:
        time.sleep(0.2)

    traffic = Traffic(client, "canary-alias")  # through the alias, all along
    try:
        time.sleep(2)
        r2 = stack.deploy(spec(tiny_model_dir, canary={"weight": 20}, engine={"max_num_seqs": 12}))
        assert r2["revision"] == 2 and r2["deployment"]["canary"] == 2
        stack.wait_replicas("canary-demo", 1, revision=2)
        # The registry says ready a moment before the scheduler has the replica's heartbeat
        # (until then requests drawn for revision 2 go to revision 1): measure from its first.
        deadline = time.monotonic() + 20
        while 2 not in traffic.served and time.monotonic() < deadline:
            time.sleep(0.05)

        start = len(traffic.served)
        deadline = time.monotonic() + 120
        while len(traffic.served) - start < 300 and time.monotonic() < deadline:
            time.sleep(0.2)
        window = traffic.served[start:start + 300]
        assert len(window) == 300, f"only {len(window)} requests in 120 s"
        share = window.count(2) / len(window)
        print(f"canary share over 300 requests: {share:.1%} (asked: 20%)")
        # Binomial(300, 0.2) falls outside 10-30% once in 67,000 runs (three standard
        # deviations, 13-27%, failed once in 520); an even split or none would still fail.
        assert 0.10 <= share <= 0.30, f"canary share {share:.2%}"
        assert set(window) <= {1, 2}

        status = control.status("canary-demo")
        assert status["serving"] == {"1": 80, "2": 20}
        assert {r["revision"] for r in status["replicas"]} >= {1, 2}

        rolled = control.rollback("canary-demo")
        assert rolled["serving"] == {"1": 100}
        time.sleep(1.0)  # announcement in flight: requests already routed may still land on r2
        after = len(traffic.served)
        deadline = time.monotonic() + 30
        while len(traffic.served) - after < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(traffic.served[after:]) == {1}, "rolled back, yet revision 2 still served"
    finally:
        traffic.stop()
    assert traffic.failures == [], traffic.failures[:5]

    events = control.history("canary-demo")["events"]
    assert [e["action"] for e in events] == ["apply", "apply", "rollback"]
    with pytest.raises(ControlError) as info:
        control.promote("canary-demo")  # nothing to promote after the rollback
    assert info.value.status == 409


def test_bad_spec_is_refused_over_http_and_nothing_is_stored(managed_stack):
    control = managed_stack.client
    with pytest.raises(ControlError) as info:
        control.deploy("name: broken\nmodel: /nowhere\nreplicas: {min: 3, max: 1}\n")
    assert info.value.status == 400
    fields = {e["field"] for e in info.value.body["error"]["errors"]}
    assert fields == {"model", "replicas"}
    assert "broken" not in [d["name"] for d in control.deployments()["deployments"]]
    with pytest.raises(ControlError) as info:
        control.status("broken")
    assert info.value.status == 404


def test_control_api_requires_an_admin_key(managed_stack):
    from services.control.client import ControlClient

    with pytest.raises(ControlError) as info:
        ControlClient(managed_stack.control_url, "sk-strata-not-a-key").deployments()
    assert info.value.status == 401 and info.value.body["error"]["type"] == "authentication_error"
    tenant_key = managed_stack.client.create_key("tenant-a")["api_key"]
    with pytest.raises(ControlError) as info:
        ControlClient(managed_stack.control_url, tenant_key).deployments()
    assert info.value.status == 403


# ---- the automatic canary analysis (services.control.canary) ----------------------------------
# Limits of 3x: on this tiny model stable's TTFT p90 is ~9 ms and its ITL ~1.5 ms, where a fresh
# engine on a loaded 2-core machine can be 1.5x off while healthy; the slow canary (+50 ms a step)
# is 12x and 34x.
ANALYSIS = {"steps": [20, 50, 100], "interval_s": 2, "min_requests": 20,
            "thresholds": {"ttft_p90_ratio": 3.0, "itl_p50_ratio": 3.0}}
AUTO = "auto-canary"


def auto_spec(model_dir, **extra):
    return {"name": AUTO, "model": str(model_dir), "replicas": {"min": 1, "max": 1},
            "engine": {"max_num_seqs": 16}, **extra}


class TimedTraffic(Traffic):
    """Traffic that also notes when each revision served: time to rollback is measured from the
    canary's first request."""

    def __init__(self, *args, **kwargs):
        self.first_served: dict[int, float] = {}
        super().__init__(*args, **kwargs)

    def one(self) -> int | None:
        try:
            r = self.client.completions.create(model=self.model, prompt="The canary says", max_tokens=4,
                                               extra_body={"ignore_eos": True}, timeout=30)
            revision = r.model_extra["strata"]["revision"]
            self.first_served.setdefault(revision, time.time())
            self.served.append(revision)
            return revision
        except Exception as exc:  # recorded: the test asserts there were none
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return None


def wait_analysis(control, name: str, revision: int, timeout: float) -> dict:
    """Until the analysis of `revision` ends (promoted, rolled back, ...); returns it."""
    deadline = time.monotonic() + timeout
    analysis = None
    while time.monotonic() < deadline:
        analysis = control.canary_status(name)["analysis"]
        if analysis["canary"] == revision and analysis["status"] != "running":
            return analysis
        time.sleep(0.5)
    raise AssertionError(f"the analysis of r{revision} did not end within {timeout:.0f} s: {analysis}")


def cli(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.control.cli", *args, "--control-url", stack.control_url,
                           "--api-key", stack.api_key], capture_output=True, text=True, timeout=60)


def test_the_analysis_rolls_a_slow_canary_back_and_promotes_a_healthy_one(managed_stack, tiny_model_dir):
    stack, control = managed_stack, managed_stack.client
    try:
        check_automatic_analysis(stack, control, tiny_model_dir)
    finally:
        control.delete(AUTO)


def check_automatic_analysis(stack, control, tiny_model_dir):
    stack.deploy(auto_spec(tiny_model_dir))
    stack.wait_replicas(AUTO, 1, revision=1)
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and AUTO not in [m.id for m in client.models.list()]:
        time.sleep(0.2)
    traffic = TimedTraffic(client, AUTO)
    try:
        time.sleep(2)
        # Revision 2: every engine step slowed by 50 ms (a test-only flag): a bad deploy.
        spec_text = json.dumps(auto_spec(tiny_model_dir, engine={"max_num_seqs": 16, "debug_step_delay": 0.05},
                                         canary={"analysis": ANALYSIS}))
        out = subprocess.run([sys.executable, "-m", "services.control.cli", "deploy", "-", "--control-url",
                              stack.control_url, "--api-key", stack.api_key], input=spec_text, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"{AUTO}: revision 2 applied; traffic r1 80%, r2 20%" in out.stdout, out.stdout  # the true split
        assert "canary analysis: r2 at 20% -> 50%, then promoted to 100%" in out.stdout, out.stdout
        assert f"control: {stack.control_url} (--control-url)" in out.stderr, out.stderr

        rolled = wait_analysis(control, AUTO, 2, timeout=240)
        assert rolled["status"] == "rolled_back", rolled
        assert control.status(AUTO)["serving"] == {"1": 100}
        event = control.history(AUTO)["events"][-1]
        assert (event["action"], event["actor"]) == ("rollback", "canary-analysis"), event
        verdict = event["analysis"]
        assert verdict["decision"] == "fail" and verdict["step"] == 20, verdict  # caught at its first step
        assert verdict["canary_requests"] >= 20 and verdict["stable_requests"] >= 20, verdict
        failed = {c["name"] for c in verdict["checks"] if c["failed"]}
        assert failed & {"ttft_p90", "itl_p50"}, verdict
        assert "rank test p=" in verdict["reason"], verdict
        took = event["at"] - traffic.first_served[2]
        print(f"\ntime to rollback: {took:.1f} s from the canary's first request ({verdict['canary_requests']} "
              f"canary, {verdict['stable_requests']} stable requests over a {verdict['window_s']:.1f} s window; "
              f"{verdict['reason']})")

        status = cli(stack, "canary", "status", AUTO)
        assert status.returncode == 0, status.stderr
        assert "status:  rolled_back" in status.stdout and "FAIL at 20%" in status.stdout, status.stdout

        # diagnose names the automatic rollback as the tooling layer's event.
        out = subprocess.run([sys.executable, "-m", "services.control.cli", "diagnose", "--deployment", AUTO,
                              "--redis-url", stack.infra.redis_url, "--since", "5m", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        found = json.loads(out.stdout)["verdict"]
        assert (found["layer"], found["area"]) == ("tooling", "canary rollback"), found
        assert "rolled revision 2 back" in found["summary"], found

        # Revision 3: healthy, the same engine as stable: walked through 20% and 50%, then promoted.
        stack.deploy(auto_spec(tiny_model_dir, canary={"analysis": ANALYSIS}))
        promoted = wait_analysis(control, AUTO, 3, timeout=300)
        assert promoted["status"] == "promoted", [v.get("reason") for v in promoted.get("verdicts", [])]
        assert [v["step"] for v in promoted["verdicts"]] == [20, 50], promoted
        assert all(v["decision"] == "pass" for v in promoted["verdicts"]), promoted
        assert control.status(AUTO)["serving"] == {"3": 100}
        events = [e for e in control.history(AUTO)["events"] if e["generation"] > event["generation"]]
        assert [(e["action"], e["actor"], e["canary_weight"]) for e in events] == [
            ("apply", "local-dev", 20), ("canary", "canary-analysis", 50), ("promote", "canary-analysis", 0)], events
        time.sleep(1.0)  # announcement in flight
        after = len(traffic.served)
        deadline = time.monotonic() + 30
        while len(traffic.served) - after < 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(traffic.served[after:]) == {3}, "promoted, yet another revision still served"
    finally:
        traffic.stop()
    assert traffic.failures == [], traffic.failures[:5]
    assert {1, 2, 3} <= set(traffic.served)
