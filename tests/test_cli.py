"""`strata up` brings up the local infrastructure and stops cleanly on Ctrl-C."""

import os
import signal
import subprocess
import sys
import time


def test_strata_up_starts_and_stops(tmp_path, tiny_model_dir):
    env = dict(os.environ, STRATA_HOME=str(tmp_path), STRATA_MODEL=str(tiny_model_dir))
    proc = subprocess.Popen([sys.executable, "-m", "services.control.cli", "up"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.strip().startswith("redis:") or not line:
                break
        out = "".join(lines)
        assert "nats:  nats://127.0.0.1:" in out and "redis: redis://127.0.0.1:" in out, out
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
