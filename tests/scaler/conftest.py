"""Fixtures of the scaler's tests."""

import pytest


@pytest.fixture
def fake_engine_processes(tmp_path, monkeypatch):
    """Engines started as `<python> -m services.engine ...` become a sleeping shell."""
    exe = tmp_path / "fake-engine-python"
    exe.write_text("#!/bin/sh\nexec sleep 60\n")
    exe.chmod(0o755)
    monkeypatch.setattr("services.scaler.actuators.sys.executable", str(exe))
