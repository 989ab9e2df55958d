"""One local stack exporting traces to a real OTLP/HTTP receiver (tests/otlp.py), shared by the
observability tests.

The stack serves three deployments of the tiny model, each set up for one kind of trouble:
  tiny-a  1 engine, max_num_seqs 2: too few replicas for a burst (admission wait)
  tiny-b  2 engines under round_robin routing (shared-prefix traffic spreads); also the
          deployment the tracing, timing and log tests use
  tiny-c  1 engine slowed by the test-only --debug-step-delay (a slow runtime)
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from shared.localstack import LocalStack
from tests.otlp import OtlpReceiver

STEP_DELAY = 0.1  # tiny-c's engine sleeps this long in every step


@pytest.fixture(scope="package")
def otlp() -> OtlpReceiver:
    receiver = OtlpReceiver()
    receiver.serve()
    return receiver


@pytest.fixture(scope="package")
def obs_stack(infra, tiny_model_dir, tmp_path_factory, otlp):
    models = tmp_path_factory.mktemp("obs-models")
    serve = []
    for name in ("tiny-a", "tiny-b", "tiny-c"):
        shutil.copytree(tiny_model_dir, models / name)
        serve += ["--serve", str(models / name)]
    # The services are child processes: they inherit the OTLP settings from the environment.
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_BSP_SCHEDULE_DELAY")}
    os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint, OTEL_BSP_SCHEDULE_DELAY="100")
    stack = LocalStack(str(tiny_model_dir), engines=0, nats_url=infra.nats_url, redis_url=infra.redis_url,
                       engine_args=["--threads", "1", "--num-kv-blocks", "512"], gateway_args=serve,
                       scheduler_args=["--policy-for", "tiny-b=round_robin"],
                       log_dir=tmp_path_factory.mktemp("obs-logs"))
    try:
        stack.start()
        stack.start_engine("engine-a0", "--max-num-seqs", "2", deployment="tiny-a")
        stack.start_engine("engine-b0", deployment="tiny-b")
        stack.start_engine("engine-b1", deployment="tiny-b")
        stack.start_engine("engine-c0", "--debug-step-delay", str(STEP_DELAY), deployment="tiny-c")
        stack.wait_ready(180)
        time.sleep(1.5)  # the scheduler has heard every engine's heartbeat
        yield stack
    finally:
        stack.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
