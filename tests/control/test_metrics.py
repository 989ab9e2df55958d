"""Metrics as operators' tools read them, on a live stack: every vLLM metric name scraped from a
running engine, engines found through the registry (`strata status`, control's Prometheus service
discovery), the Grafana dashboards and alert rules naming only metrics the services export, a
real Prometheus server (Debian's) scraping the stack and answering every dashboard query, and the
canary analysis' custom Prometheus check rolling a canary back."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from shared.localstack import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
NAME = "metrics-demo"
VLLM_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
              "vllm:num_preemptions_total"]
METRIC_NAME = re.compile(r"\b(?:strata|vllm):[a-z0-9_:]*[a-z0-9_]")


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def exported_names(text: str) -> set[str]:
    """Every series name an exposition can have: from the families' TYPE lines (a family with no
    children yet still has one), with the suffixes Prometheus stores them under."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                        "summary": ["_sum", "_count", "_created"]}.get(kind, [""])
            names |= {name.removesuffix("_total") + s if kind == "counter" else name + s for s in suffixes}
    return names


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard, panel, expr) of every query, template variables' queries included."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                out.append((path.name, f"variable {var['name']}", var["query"]["query"]))
        for note in board["annotations"]["list"]:
            if "expr" in note:
                out.append((path.name, f"annotation {note['name']}", note["expr"]))
    return out


def promql(expr: str) -> str:
    """A Grafana query as Prometheus runs it: template variables replaced as Grafana would."""
    match = re.fullmatch(r"label_values\((.+), (\w+)\)", expr)
    if match:
        return f"count by ({match.group(2)}) ({match.group(1)})"
    for var, value in (("$__rate_interval", "15s"), ("$__range", "5m"), ("$model_name", ".*"),
                       ("$deployment", ".*")):
        expr = expr.replace(var, value)
    return expr


@pytest.fixture(scope="module")
def deployed(managed_stack, tiny_model_dir):
    stack = managed_stack
    stack.deploy({"name": NAME, "model": str(tiny_model_dir), "replicas": {"min": 1, "max": 1}})
    stack.wait_replicas(NAME, 1, revision=1)
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and NAME not in [m.id for m in client.models.list()]:
        time.sleep(0.2)
    for i in range(6):  # a shared prefix: the prefix cache gets queries and hits
        client.completions.create(model=NAME, prompt="The metrics of the engine, request " * 4 + str(i),
                                  max_tokens=5, timeout=60)
    yield stack, client
    stack.client.delete(NAME)


def test_every_vllm_metric_name_is_scraped_from_a_live_engine(deployed):
    stack, _ = deployed
    status = stack.client.status(NAME)
    (replica,) = status["replicas"]
    # The engine's metrics URL is advertised: in the registry, in `strata status`.
    assert replica["metrics_url"] and replica["metrics_url"].endswith("/metrics"), replica
    out = subprocess.run([sys.executable, "-m", "services.control.cli", "status", NAME, "--control-url",
                          stack.control_url, "--api-key", stack.api_key], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and replica["metrics_url"] in out.stdout, out.stdout + out.stderr

    families = {f.name: f for f in text_string_to_metric_families(get(replica["metrics_url"]))}
    for name in VLLM_NAMES:
        family = families.get(name.removesuffix("_total"))
        assert family is not None, f"{name} is not exported"
        labels = {k: v for s in family.samples for k, v in s.labels.items()}
        assert labels.get("model_name") == NAME and labels.get("engine") == "0", (name, labels)
    value = {s.name: s.value for f in families.values() for s in f.samples}
    assert value["vllm:prompt_tokens_total"] > 0 and value["vllm:generation_tokens_total"] >= 30
    assert value["vllm:time_to_first_token_seconds_count"] >= 6
    assert value["vllm:prefix_cache_hits_total"] > 0
    # The same objects as Strata's own names: the two never disagree.
    assert value["vllm:generation_tokens_total"] == value["strata:generation_tokens_total"]
    assert value["vllm:e2e_request_latency_seconds_sum"] == value["strata:e2e_request_latency_seconds_sum"]


def test_prometheus_service_discovery_lists_the_registered_engines(deployed):
    stack, _ = deployed
    groups = json.loads(get(f"{stack.control_url}/prometheus/targets"))  # no key: addresses only, like /metrics
    mine = [g for g in groups if g["labels"]["deployment"] == NAME]
    assert len(mine) == 1 and mine[0]["labels"]["revision"] == "1" and mine[0]["labels"]["kind"] == "engine", groups
    metrics_url = stack.client.status(NAME)["replicas"][0]["metrics_url"]
    assert metrics_url == f"http://{mine[0]['targets'][0]}/metrics"
    everything = json.loads(get(f"{stack.control_url}/prometheus/targets?kind=all"))
    assert {"engine", "gateway", "scheduler", "scaler", "control"} <= {g["labels"]["kind"] for g in everything}


def test_dashboards_and_alerts_name_only_exported_metrics(deployed):
    stack, _ = deployed
    groups = json.loads(get(f"{stack.control_url}/prometheus/targets?kind=all"))
    kinds = {g["labels"]["kind"] for g in groups}
    exported = set()
    for group in groups:
        exported |= exported_names(get(f"http://{group['targets'][0]}/metrics"))
    assert kinds >= {"engine", "gateway", "scheduler", "scaler", "control"}
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    used: dict[str, list[str]] = {}
    for board, panel, expr in dashboard_exprs():
        for name in METRIC_NAME.findall(expr):
            used.setdefault(name, []).append(f"{board}: {panel}")
    for rule in rules:
        for name in METRIC_NAME.findall(rule["expr"]):
            used.setdefault(name, []).append(f"alerts.yml: {rule.get('alert') or rule.get('record')}")
    assert len(used) > 30
    unknown = {name: where for name, where in used.items() if name not in exported | recorded}
    assert not unknown, f"names no service exports: {unknown}"
    # Every layer's board reads what its layer exports; the runtime one only vLLM's names (and the step).
    runtime = {n for b, _, e in dashboard_exprs() if b == "runtime.json" for n in METRIC_NAME.findall(e)}
    assert {n.removesuffix("_total") for n in VLLM_NAMES} <= {re.sub(r"_(bucket|sum|count|total)$", "", n)
                                                             for n in runtime}


@pytest.fixture(scope="module")
def prometheus(deployed, tmp_path_factory):
    """Debian's Prometheus server, scraping the stack every second through control's discovery."""
    stack, _ = deployed
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is needed and not installed: apt-get install -y prometheus (.ci/run does)"
    work = tmp_path_factory.mktemp("prometheus")
    shutil.copy(ALERTS, work / "alerts.yml")
    (work / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [{"job_name": "strata", "http_sd_configs": [
            {"url": f"{stack.control_url}/prometheus/targets?kind=all", "refresh_interval": "1s"}],
            "relabel_configs": [{"source_labels": ["kind"], "target_label": "job"}]}]}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                targets = json.loads(get(f"{url}/api/v1/targets"))["data"]["activeTargets"]
                jobs = {t["labels"]["job"] for t in targets if t["health"] == "up"}
                if {"engine", "gateway", "scheduler", "scaler", "control"} <= jobs:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"Prometheus did not scrape every service within 60 s: {jobs}"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def query(url: str, expr: str) -> dict:
    try:
        return json.loads(get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    except urllib.error.HTTPError as exc:  # a bad query is a 400 with the parser's message
        return json.loads(exc.read())


def test_a_real_prometheus_answers_every_dashboard_query(deployed, prometheus):
    stack, client = deployed
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # a few scrapes with traffic between them: rates have data
        client.completions.create(model=NAME, prompt="Grafana reads this", max_tokens=3, timeout=60)
        up = query(prometheus, f'vllm:time_to_first_token_seconds_count{{model_name="{NAME}"}}')["data"]["result"]
        if up and float(up[0]["value"][1]) >= 12:
            break
        time.sleep(0.5)
    time.sleep(3)
    empty = []
    for board, panel, expr in dashboard_exprs():
        body = query(prometheus, promql(expr))
        assert body["status"] == "success", (board, panel, expr, body)
        if not body["data"]["result"]:
            empty.append(f"{board}: {panel}: {expr}")
    runtime_empty = [e for e in empty if e.startswith("runtime.json")]
    assert not runtime_empty, runtime_empty
    # The per-revision panels need the revision label that control's discovery gives engines.
    per_revision = query(prometheus, f'count by (model_name, revision) (vllm:num_requests_running{{model_name="{NAME}"}})')
    assert per_revision["data"]["result"][0]["metric"]["revision"] == "1", per_revision
    # The alert rules load and their recording rules evaluate on live series.
    rules = json.loads(get(f"{prometheus}/api/v1/rules"))["data"]["groups"]
    assert {g["name"] for g in rules} == {"strata-slo", "strata-capacity", "strata-replicas", "strata-tooling"}
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    print(f"\n{len(dashboard_exprs())} dashboard queries run; empty on this stack (no such event yet): {len(empty)}")
    for line in empty:
        print(f"  {line[:160]}")


def test_the_canary_analysis_custom_prometheus_check_rolls_back(deployed, prometheus, tiny_model_dir):
    """An operator's PromQL check, with $deployment and $canary filled in, on the real server:
    the canary's engine counts running requests + 1 > 0.5, so the step fails and rolls back."""
    stack, client = deployed
    check = {"url": prometheus, "max": 0.5,
             "query": 'sum(vllm:num_requests_running{deployment="$deployment", revision="$canary"}) + 1'}
    stack.deploy({"name": NAME, "model": str(tiny_model_dir), "replicas": {"min": 1, "max": 1},
                  "canary": {"analysis": {"steps": [50, 100], "interval_s": 1, "min_requests": 5, "prometheus": check,
                                          "thresholds": {"ttft_p90_ratio": 100, "itl_p50_ratio": 100}}}})
    deadline = time.monotonic() + 180
    analysis = None
    while time.monotonic() < deadline:
        for _ in range(4):
            client.completions.create(model=NAME, prompt="Custom check", max_tokens=2, timeout=60)
        analysis = stack.client.canary_status(NAME)["analysis"]
        if analysis["status"] != "running":
            break
    assert analysis["status"] == "rolled_back", analysis
    verdict = analysis["verdicts"][-1]
    (failed,) = [c for c in verdict["checks"] if c["failed"]]
    assert failed["name"] == "prometheus" and failed["effect"] >= 1, failed
    assert f'deployment="{NAME}"' not in failed["detail"]  # the query as written, with its placeholders
    assert "(max 0.5)" in verdict["reason"]
    assert stack.client.status(NAME)["serving"] == {"1": 100}
