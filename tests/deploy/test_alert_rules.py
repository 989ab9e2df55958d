"""deploy/prometheus: the alert rules and the config validate with Prometheus' own promtool, and
every alert fires on the series made for it (deploy/prometheus/alerts_test.yml)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.manifests import PROMETHEUS_FILE

RULES = PROMETHEUS_FILE.with_name("alerts.yml")
RULE_TESTS = PROMETHEUS_FILE.with_name("alerts_test.yml")


@pytest.fixture(scope="module")
def promtool() -> str:
    """Debian's `prometheus` package: a failure, not a skip, where it is missing (CI installs it)."""
    binary = shutil.which("promtool")
    assert binary, "promtool is needed and not installed: apt-get install -y prometheus (.ci/run installs it)"
    return binary


def run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS_FILE.parent)


def test_the_rules_and_the_config_validate(promtool):
    out = run(promtool, "check", "rules", RULES.name)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    out = run(promtool, "check", "config", PROMETHEUS_FILE.name)  # loads alerts.yml through rule_files
    assert out.returncode == 0 and "1 rule files found" in out.stdout, out.stdout + out.stderr


def test_every_alert_fires_on_its_series_and_not_on_healthy_ones(promtool):
    out = run(promtool, "test", "rules", RULE_TESTS.name)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert fired == alerts, f"alerts without a test that fires them: {alerts - fired}"
    assert {"StrataErrorBudgetBurnFast", "StrataTTFTBudgetBurnFast", "StrataAdmissionQueueGrowing", "StrataEngineDown",
            "StrataReplicasMissing", "StrataCanaryRolledBack"} <= alerts


def test_a_broken_rule_is_refused(promtool, tmp_path):
    """promtool is no rubber stamp: a rule with bad PromQL fails the check."""
    broken = tmp_path / "broken.yml"
    broken.write_text("groups:\n  - name: x\n    rules:\n      - alert: Broken\n        expr: sum(rate(x[5m])\n")
    out = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr
