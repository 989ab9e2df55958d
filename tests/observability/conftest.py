"""A real OTLP/HTTP receiver and one local stack exporting to it, shared by the observability tests.

The stack serves three deployments of the tiny model, each set up for one kind of trouble:
  tiny-a  1 engine, max_num_seqs 2: too few replicas for a burst (admission wait)
  tiny-b  2 engines under round_robin routing (shared-prefix traffic spreads); also the
          deployment the tracing, timing and log tests use
  tiny-c  1 engine slowed by the test-only --debug-step-delay (a slow runtime)
"""

from __future__ import annotations

import asyncio
import gzip
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

from shared.localstack import LocalStack, free_port

STEP_DELAY = 0.1  # tiny-c's engine sleeps this long in every step


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class OtlpReceiver:
    """POST /v1/traces: decodes each ExportTraceServiceRequest (protobuf) into ReceivedSpans."""

    port: int = field(default_factory=free_port)
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        self.requests += 1
        for rs in export.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(ReceivedSpan(
                        resource.get("service.name", ""), s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.name, s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes}))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def serve(self) -> None:
        """Run on a thread of its own: the stack's start blocks the test's thread."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/v1/traces", self._traces)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            ready.set()
            loop.run_forever()

        threading.Thread(target=run, name="otlp-receiver", daemon=True).start()
        assert ready.wait(10)

    def wait_for(self, predicate, timeout: float = 20.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in list(self.spans) if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        return []


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
