"""`strata diagnose` names a bad canary revision as the tooling layer's trouble, on a live stack."""

import json
import subprocess
import sys
import time

import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow


def test_a_slow_canary_revision_is_tooling(managed_stack, tiny_model_dir):
    stack = managed_stack
    base = {"name": "diag-canary", "model": str(tiny_model_dir), "replicas": {"min": 1, "max": 1}}
    try:
        stack.deploy(base)
        stack.wait_replicas("diag-canary", 1, revision=1)
        # Revision 2: the same model on an engine slowed on purpose (test-only flag), half the traffic.
        stack.deploy({**base, "canary": {"weight": 50}, "engine": {"debug_step_delay": 0.05}})
        stack.wait_replicas("diag-canary", 1, revision=2)
        client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
        # The registry says ready a moment before the scheduler has the replica's heartbeat;
        # until then a request drawn for revision 2 goes to revision 1.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and client.completions.create(
                model="diag-canary", prompt="Warm", max_tokens=1, timeout=60).model_extra["strata"]["revision"] != 2:
            pass
        served = [client.completions.create(model="diag-canary", prompt=f"Canary {i}", max_tokens=6,
                                            extra_body={"ignore_eos": True}, timeout=60).model_extra["strata"]
                  for i in range(30)]
        assert {s["revision"] for s in served} == {1, 2}

        out = subprocess.run([sys.executable, "-m", "services.control.cli", "diagnose", "--deployment", "diag-canary",
                              "--redis-url", stack.infra.redis_url, "--since", "0", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        verdict = json.loads(out.stdout)["verdict"]
        assert (verdict["layer"], verdict["area"]) == ("tooling", "revision"), verdict
        assert "revision 2" in verdict["summary"] and "slower than revision 1" in verdict["summary"], verdict
        assert verdict["fix"].startswith("roll back revision 2"), verdict
    finally:
        stack.client.delete("diag-canary")


def test_a_cold_start_is_not_called_saturation(managed_stack, tiny_model_dir):
    """A deployment scaled to zero: the first requests wait in the admission queue while the
    scaler starts its engine. That is a cold start, and diagnose says so (not "saturated")."""
    import concurrent.futures

    stack = managed_stack
    stack.deploy({"name": "diag-cold", "model": str(tiny_model_dir), "replicas": {"min": 0, "max": 1}})
    try:
        client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "diag-cold" not in [m.id for m in client.models.list()]:
            time.sleep(0.2)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            served = list(pool.map(lambda i: client.completions.create(
                model="diag-cold", prompt=f"Cold {i}", max_tokens=4, timeout=180).model_extra["strata"], range(6)))
        assert min(s["timings"]["admission_wait"] for s in served) > 1.0, served  # they waited for the engine

        out = subprocess.run([sys.executable, "-m", "services.control.cli", "diagnose", "--deployment", "diag-cold",
                              "--redis-url", stack.infra.redis_url, "--since", "2m", "--json", "--itl-slo", "0.5"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        verdict = json.loads(out.stdout)["verdict"]
        assert (verdict["layer"], verdict["area"]) == ("infrastructure", "cold start"), verdict
        assert "not saturation" in verdict["summary"] and "replicas.min 0" in verdict["fix"], verdict
    finally:
        stack.client.delete("diag-cold")
