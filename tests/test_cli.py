"""`strata up` brings the whole stack up, serves a request, and stops cleanly on Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def test_strata_up_serves_and_stops(tmp_path, tiny_model_dir):
    env = dict(os.environ, STRATA_HOME=str(tmp_path), STRATA_MODEL=str(tiny_model_dir))
    env.pop("STRATA_NATS_URL", None)
    env.pop("STRATA_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.control.cli", "up", "--port", "0",
                             "--engines", "1", "--control-port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        # "up" means it serves: the first completion, right away, succeeds.
        request = urllib.request.Request(lines["base url"] + "/completions", method="POST", data=json.dumps(
            {"model": "tiny-llama", "prompt": "first", "max_tokens": 2}).encode(), headers={
            "Authorization": f"Bearer {lines['api key']}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 2
        # Its NATS admits the services' roles only; the admin's credentials are where it says.
        creds = lines["nats"].split("credentials: ")[1].rstrip(")")
        assert (tmp_path / "nats" / "admin.env").read_text().startswith("STRATA_NATS_USER=admin")
        assert str(tmp_path / "nats") == creds and oct((tmp_path / "nats" / "client.env").stat().st_mode)[-3:] == "600"
        # The CLI finds control and the admin key `strata up` saved, and reads the fleet.
        status = subprocess.run([sys.executable, "-m", "services.control.cli", "status", "tiny-llama"], env=env,
                                capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        assert "traffic:    r1 100%" in status.stdout and "ready" in status.stdout, status.stdout
        # The store loses everything (FLUSHALL: as if Valkey restarted empty): `strata up` provisions
        # its admin key again (create_key stamps `created`; a gateway or control writing back a key
        # it knew does not), control writes the deployment back, and it serves on.
        import redis

        from services.gateway.auth import hash_key
        from shared import keys
        store = redis.Redis.from_url(lines["redis"])
        store.flushall()
        deadline = time.monotonic() + 15
        while not (store.hexists(keys.api_key(hash_key(lines["api key"])), "created")
                   and store.exists(keys.deployment("tiny-llama"))):
            assert time.monotonic() < deadline, "the admin key or the deployment did not come back"
            time.sleep(0.2)
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_strata_simulate_writes_its_report(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.control.cli", "simulate", "bursty", "--replicas-max", "20",
                          "--duration", "1800", "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["trace"]["name"] == "bursty" and report["trace"]["requests"] > 0
    assert (tmp_path / "simulate.json").exists() and (tmp_path / "simulate.png").stat().st_size > 0
