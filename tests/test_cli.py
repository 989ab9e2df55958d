"""`strata up` brings the whole stack up, saves every address it printed for the commands that
follow, serves the README's example, and stops cleanly on Ctrl-C; the CLI's rough edges, each
tried as a new user would."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shared.localstack import free_port

ROOT = Path(__file__).resolve().parents[1]


def strata(env: dict, *args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.control.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def http_status(url: str, key: str, body: dict | None = None) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"```python\n(from openai import OpenAI\n.*?)```", text, re.S).group(1)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} not healthy after {timeout} s")


@pytest.mark.slow
def test_strata_up_serves_and_stops(tmp_path, tiny_model_dir):
    env = dict(os.environ, STRATA_HOME=str(tmp_path), STRATA_MODEL=str(tiny_model_dir))
    for name in ("STRATA_NATS_URL", "STRATA_REDIS_URL", "STRATA_CONTROL_URL", "STRATA_API_KEY"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "services.control.cli", "up", "--port", "0",
                             "--engines", "1", "--control-port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second_gateway = None
    try:
        lines = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if ":" in line:
                k, _, v = line.strip().partition(":")
                lines[k.strip()] = v.strip()
            if line.startswith("Ctrl-C"):
                break
        assert "base url" in lines and lines["api key"].startswith("sk-strata-"), (lines, proc.stderr.read())
        request = urllib.request.Request(lines["base url"] + "/models",
                                         headers={"Authorization": f"Bearer {lines['api key']}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.load(resp)["data"][0]["id"] == "tiny-llama"

        # Every address it printed is saved, per home, for the commands that follow.
        saved = json.loads((tmp_path / "cli.json").read_text())
        assert saved["base_url"] == lines["base url"] and saved["api_key"] == lines["api key"]
        assert saved["nats_url"] == lines["nats"] and saved["redis_url"] == lines["redis"]
        assert saved["control_url"] == lines["control"].split()[0] and saved["log_dir"] == lines["logs"]
        assert saved["dashboard_url"].startswith(saved["control_url"] + "/dashboard#key=")
        assert oct((tmp_path / "cli.json").stat().st_mode & 0o777) == "0o600"  # it holds an admin key

        # The CLI finds control and the admin key `strata up` saved, says so, and reads the fleet.
        status = strata(env, "status", "tiny-llama")
        assert status.returncode == 0, status.stderr
        assert "traffic:    r1 100%" in status.stdout and "ready" in status.stdout, status.stdout
        assert f"control: {saved['control_url']} ({tmp_path / 'cli.json'}, written by strata up)" in status.stderr

        # The README's example, as printed there (with this stack's URL and key): it sets max_tokens.
        example = readme_example()
        assert "max_tokens=" in example
        example = example.replace("http://127.0.0.1:8000/v1", saved["base_url"]).replace('"sk-strata-..."',
                                                                                          repr(saved["api_key"]))
        example += "\nimport json; print('RESPONSE ' + json.dumps(client.chat.completions.create(model='tiny-llama', " \
                   "messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=4).model_dump()))\n"
        ran = subprocess.run([sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        response = json.loads(ran.stdout.split("RESPONSE ", 1)[1])

        # `strata logs` without a URL (the saved one), by the response id or the x-request-id,
        # lines already logged, and exits (--no-follow).
        rid = response["id"]
        assert rid.startswith("chatcmpl-")
        for given in (rid, rid.removeprefix("chatcmpl-")):
            deadline = time.monotonic() + 20
            while True:
                logs = strata(env, "logs", "--request", given, "--no-follow", "--json")
                services = {json.loads(line)["service"] for line in logs.stdout.splitlines()}
                if services >= {"gateway", "scheduler", "engine"} or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert logs.returncode == 0 and services >= {"gateway", "scheduler", "engine"}, logs.stderr
            assert all(json.loads(line)["request_id"] == rid.removeprefix("chatcmpl-")
                       for line in logs.stdout.splitlines())
        missing = strata(env, "logs", "--request", "chatcmpl-0123456789abcdef", "--no-follow")
        assert missing.returncode == 1 and "no log lines for request 0123456789abcdef" in missing.stderr

        # `strata diagnose` without --redis-url: the saved registry.
        diagnose = strata(env, "diagnose", "--since", "0")
        assert diagnose.returncode == 0 and "engine tiny-llama-r1" in diagnose.stdout, diagnose.stderr

        # Keys: created, listed, revoked; a second gateway on the same stack too refuses it within a second.
        port = free_port()
        second_gateway = subprocess.Popen([sys.executable, "-m", "services.gateway", "--port", str(port),
                                           "--gateway-id", "gateway-second", "--nats-url", saved["nats_url"],
                                           "--redis-url", saved["redis_url"], "--log-format", "json"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"http://127.0.0.1:{port}", second_gateway)
        created = strata(env, "keys", "create", "--name", "team-a", "--json")
        assert created.returncode == 0, created.stderr
        key, key_id = json.loads(created.stdout)["api_key"], json.loads(created.stdout)["id"]
        gateways = [saved["base_url"], f"http://127.0.0.1:{port}/v1"]
        deadline = time.monotonic() + 20  # the second gateway learns the deployment from control
        while http_status(gateways[1] + "/models", key) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        body = {"model": "tiny-llama", "prompt": "key", "max_tokens": 1}
        assert [http_status(g + "/completions", key, body) for g in gateways] == [200, 200]  # cached now
        listed = strata(env, "keys", "list")
        assert listed.returncode == 0 and re.search(rf"{key_id}\s+team-a\s+standard", listed.stdout), listed.stdout
        assert key not in listed.stdout
        revoked = strata(env, "keys", "revoke", key_id[:8])
        assert revoked.returncode == 0 and f"revoked key {key_id}" in revoked.stdout, revoked.stderr
        started = time.monotonic()
        refused = [False, False]
        while not all(refused) and time.monotonic() - started < 1.0:
            refused = [http_status(g + "/completions", key, body) == 401 for g in gateways]
        print(f"\nrevoked key refused by both gateways after {time.monotonic() - started:.3f} s")
        assert all(refused), "a revoked key still works on a gateway after a second"
        assert key_id not in strata(env, "keys", "list").stdout
        again = strata(env, "keys", "revoke", key_id)
        assert again.returncode == 1 and "no API key" in again.stderr

        # A second `strata up` on the same ports says so before it starts anything.
        gateway_port = int(saved["base_url"].rsplit(":", 1)[1].split("/")[0])
        busy = strata(dict(env, STRATA_HOME=str(tmp_path / "second")), "up", "--port", str(gateway_port),
                      "--control-port", "0")
        assert busy.returncode == 1 and f"port {gateway_port} (gateway) is already in use" in busy.stderr, busy.stderr
        assert not (tmp_path / "second" / "cli.json").exists() and not (tmp_path / "second" / "logs").exists()

        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        for p in (second_gateway, proc):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_a_busy_port_is_reported_before_anything_starts(tmp_path, tiny_model_dir):
    env = dict(os.environ, STRATA_HOME=str(tmp_path), STRATA_MODEL=str(tiny_model_dir))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for flags, what in ((["--port", str(port), "--control-port", "0"], "gateway"),
                            (["--port", "0", "--control-port", str(port)], "control")):
            out = strata(env, "up", *flags)
            assert out.returncode == 1, out
            assert f"port {port} ({what}) is already in use on 127.0.0.1" in out.stderr, out.stderr
            assert "nats started" not in out.stdout + out.stderr and not (tmp_path / "logs").exists()


def test_make_up_takes_arguments():
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", "up", "ARGS=--port 9000 --control-port 9081"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert ".venv/bin/strata up --port 9000 --control-port 9081" in out.stdout, out.stdout


def test_the_cli_says_which_control_it_cannot_reach(tmp_path):
    env = dict(os.environ, STRATA_HOME=str(tmp_path))
    env.pop("STRATA_CONTROL_URL", None)
    out = strata(env, "status")
    assert out.returncode == 1
    assert f"control: http://127.0.0.1:8081 (the default: no --control-url, STRATA_CONTROL_URL or " \
           f"{tmp_path / 'cli.json'})" in out.stderr, out.stderr
    out = strata(dict(env, STRATA_CONTROL_URL=f"http://127.0.0.1:{free_port()}"), "status")
    assert out.returncode == 1 and "(STRATA_CONTROL_URL)" in out.stderr and "cannot reach control" in out.stderr
    # Without a saved NATS URL, `strata logs` says what it needs.
    out = strata(env, "logs", "--no-follow")
    assert out.returncode == 2 and "--nats-url" in out.stderr


def test_canary_command_forms():
    from services.control.cli import build_parser, render_change

    args = build_parser().parse_args(["canary", "status", "tiny"])
    assert (args.name, args.target) == ("status", "tiny")
    env = dict(os.environ)
    out = strata(env, "canary", "tiny")
    assert out.returncode == 2 and "--weight is required" in out.stderr
    out = strata(env, "canary", "tiny", "extra")
    assert out.returncode == 2 and "unexpected argument 'extra'" in out.stderr
    # `deploy` prints the split the deployment now has, not "100%" for a canary.
    applied = {"deployment": {"name": "tiny", "stable": 1, "canary": 2, "canary_weight": 5}, "revision": 2,
               "serving": {"1": 95, "2": 5},
               "analysis": {"steps": [5, 25, 50, 100]}}
    assert render_change(applied).splitlines() == [
        "tiny: revision 2 applied; traffic r1 95%, r2 5%",
        "  canary analysis: r2 at 5% -> 25% -> 50%, then promoted to 100% (or rolled back when worse than r1); "
        "`strata canary status tiny` follows it"]


def test_strata_simulate_writes_its_report(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.control.cli", "simulate", "bursty", "--replicas-max", "20",
                          "--duration", "1800", "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["trace"]["name"] == "bursty" and report["trace"]["requests"] > 0
    assert (tmp_path / "simulate.json").exists() and (tmp_path / "simulate.png").stat().st_size > 0
