"""bench/process_profile.py: CPU seconds per process over a window, py-spy's speedscope summarised."""

import json
import subprocess
import sys
import time

import pytest

from bench.process_profile import CpuWindow, PySpy, format_cpu, pyspy_binary, summarize_speedscope

SPIN = "import time\ndef spin():\n    end = time.time() + {s}\n    while time.time() < end: pass\nspin()\n"


def test_cpu_window_splits_busy_from_idle_processes():
    busy = subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.5)])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        time.sleep(0.2)  # both started
        window = CpuWindow({"busy": busy.pid, "idle": idle.pid}).start()
        time.sleep(0.6)
        out = window.stop(tokens=100)
    finally:
        busy.kill(), idle.kill(), busy.wait(), idle.wait()
    busy_s, idle_s = out["processes"]["busy"], out["processes"]["idle"]
    assert busy_s["cpu_s"] > 0.2 and idle_s["cpu_s"] < 0.05
    assert busy_s["cpu_ms_per_token"] == pytest.approx(busy_s["cpu_s"] * 10, abs=1e-3)
    assert busy_s["main_thread_s"] == pytest.approx(busy_s["cpu_s"], abs=0.02)  # one thread spins
    assert out["total_cpu_s"] == pytest.approx(busy_s["cpu_s"] + idle_s["cpu_s"], abs=1e-3)
    assert out["machine_busy_s"] >= out["total_cpu_s"] - 0.05  # the machine saw at least our work
    assert "busy" in format_cpu(out).splitlines()[0]  # the busiest process first


def test_summarize_speedscope_self_and_inclusive_shares(tmp_path):
    frames = [{"name": "main", "file": "/work/x/app.py"}, {"name": "step", "file": "/v/site-packages/eng/run.py"},
              {"name": "epoll_wait", "file": ""}]
    doc = {"shared": {"frames": frames}, "profiles": [
        {"name": "Thread 1 \"MainThread\"", "samples": [[0, 2], [0, 2]], "weights": [0.25, 0.25]},
        {"name": "Thread 2 \"engine-loop\"", "samples": [[0, 1], [0, 1], [0]], "weights": [0.5, 0.5, 0.5]}]}
    path = tmp_path / "p.speedscope.json"
    path.write_text(json.dumps(doc))
    out = summarize_speedscope(path)
    assert out["sampled_s"] == 2.0
    assert out["threads"] == {"Thread 2 \"engine-loop\"": 0.75, "Thread 1 \"MainThread\"": 0.25}
    assert out["top_self"][0] == ["step (eng/run.py)", 0.5]
    assert dict(out["top_self"])["epoll_wait"] == 0.25 and dict(out["top_self"])["main (x/app.py)"] == 0.25
    assert out["top_inclusive"][0] == ["main (x/app.py)", 1.0]
    assert out["thread_categories"]["Thread 1 \"MainThread\""] == {"idle: epoll": 1.0}
    assert out["thread_categories"]["Thread 2 \"engine-loop\""] == {"step (eng/run.py)": 0.6667,
                                                                    "main (x/app.py)": 0.3333}


@pytest.mark.skipif(pyspy_binary() is None, reason="py-spy not installed (pip install -e '.[profile]')")
def test_pyspy_records_a_running_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SPIN.format(s=20)])
    try:
        time.sleep(0.3)
        spy = PySpy(tmp_path, rate=100)
        spy.start("t", {"spinner": proc.pid})
        time.sleep(1.0)
        summary = spy.stop()["spinner"]
    finally:
        proc.kill()
        proc.wait()
    assert summary["sampled_s"] > 0.5
    assert any(label.startswith("spin ") and share > 0.5 for label, share in summary["top_inclusive"])
