"""OpenTelemetry tracing for every service: set up from the standard environment, off without it.

`setup_tracing("gateway")` installs an SDK tracer provider (resource `service.name =
strata-gateway`) with a BatchSpanProcessor exporting OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT
(or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; the usual OTEL_* variables tune it
(OTEL_BSP_SCHEDULE_DELAY, OTEL_EXPORTER_OTLP_HEADERS, ...). Without an endpoint the API's
no-op tracer stays in place: spans cost a few attribute look-ups and nothing is sent, but
incoming `traceparent` headers are still passed on, so a caller's trace crosses Strata intact.

The trace of one request: the gateway's HTTP span (SERVER), the scheduler's routing span under
it, the engine's request span under that with its queue / prefill / decode phases as children.
The engine records its spans when the request finishes, from the sequence's timestamps (no span
per token or per step). Context crosses NATS as W3C headers (shared.bus).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

# Which of the design's three layers each service belongs to (resource attribute strata.layer).
SERVICE_LAYER = {"gateway": "infrastructure", "scheduler": "infrastructure", "scaler": "infrastructure",
                 "engine": "runtime", "control": "tooling"}

# GenAI semantic-convention attribute names (OpenTelemetry semconv, gen_ai.*).
GEN_AI_OPERATION = "gen_ai.operation.name"  # chat | text_completion
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
# OpenTelemetry's general attribute for the end user (OpenAI's `user` request field).
USER_ID = "user.id"
PROVIDER = "strata"

_provider = None  # the SDK provider this process installed, if any


def endpoint_configured(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup_tracing(service: str, instance: str = "") -> bool:
    """Export this process's spans over OTLP/HTTP if an endpoint is configured; True if so."""
    global _provider
    if _provider is not None or not endpoint_configured() or os.environ.get("OTEL_SDK_DISABLED") == "true":
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": f"strata-{service}", "service.namespace": "strata",
                  "strata.layer": SERVICE_LAYER.get(service, "")}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown_tracing() -> None:
    """Export what is still queued, then stop (service shutdown)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()  # flushes the batch processor
        _provider = None


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    return trace.get_tracer("strata")


def ns(unix_seconds: float) -> int:
    return int(unix_seconds * 1e9)


def record_span(name: str, start: float, end: float, parent: otel_context.Context | None = None,
                kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping | None = None,
                error: str | None = None) -> Span:
    """A span of something that already happened, from unix-second timestamps; returns it
    (ended) so children can be recorded under it with `trace.set_span_in_context(span)`."""
    span = tracer().start_span(name, context=parent, kind=kind, attributes=attributes, start_time=ns(start))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=ns(max(end, start)))
    return span


def child_context(span: Span) -> otel_context.Context:
    return trace.set_span_in_context(span)


def mark_error(span: Span, error_type: str, message: str = "") -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message or error_type))


async def observed(service: str, instance: str, nats_url: str, main, nats_auth=None):
    """Run a service's main coroutine with its spans exported (when an OTLP endpoint is set) and
    its log lines published on NATS (with the service's credentials); flush both when it ends."""
    from shared import logstream

    setup_tracing(service, instance)
    logs = await logstream.start(nats_url, service, instance, nats_auth)
    try:
        return await main
    finally:
        if logs is not None:
            await logs.close()
        shutdown_tracing()
