"""A real OTLP/HTTP receiver: decodes what Strata's services export (protobuf, as the OTLP
exporter sends it) into spans a test can look at."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

from shared.localstack import free_port


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
