"""The gateway's side of observability: the HTTP span of each generation request and the
request's one log line.

The span is the root of a request's trace (or continues the client's, if it sent a
`traceparent`): a SERVER span named like GenAI client spans, `chat <model>`, carrying the GenAI
semantic-convention attributes and the request's layer timings. Publishing to the bus inside it
puts its context on the NATS headers, so the scheduler's and engine's spans join it.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import structlog
from aiohttp import web
from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind

from shared import telemetry
from shared.logging import get_logger
from shared.protocol import GenerateRequest, TokenChunk

log = get_logger()

RECEIVED_AT = "strata_received_at"  # request key: when the handler was reached (unix seconds)
SPAN = "strata_span"
TIMINGS = "strata_timings"
GENERATION_PATHS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat"}
_request: ContextVar[web.Request | None] = ContextVar("strata_http_request", default=None)


@web.middleware
async def trace_requests(request: web.Request, handler):
    """Outermost middleware: stamps the arrival; generation requests get a span and a log line."""
    request[RECEIVED_AT] = time.time()
    _request.set(request)
    structlog.contextvars.unbind_contextvars("request_id", "user")  # keep-alive: the previous request's
    operation = GENERATION_PATHS.get(request.path) if request.method == "POST" else None
    if operation is None:
        return await handler(request)
    with telemetry.tracer().start_as_current_span(
            operation, context=propagate.extract(request.headers), kind=SpanKind.SERVER,
            record_exception=False, set_status_on_exception=False,
            attributes={"http.request.method": "POST", "http.route": request.path,
                        telemetry.GEN_AI_OPERATION: operation, telemetry.GEN_AI_PROVIDER: telemetry.PROVIDER}) as span:
        request[SPAN] = span
        status = 499
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500 or status == 499:
                telemetry.mark_error(span, "client_disconnected" if status == 499 else str(status))
            timings = request.get(TIMINGS)
            log.info("request served", path=request.path, status=status,
                     ms=round((time.time() - request[RECEIVED_AT]) * 1e3, 3),
                     **({"timings_ms": {k: round(v * 1e3, 3) for k, v in timings.items()}} if timings else {}))


def received_at() -> float:
    """When the HTTP request being served reached the gateway."""
    request = _request.get()
    return request[RECEIVED_AT] if request is not None else time.time()


def annotate_request(gen: GenerateRequest, stream: bool) -> None:
    """What was asked: on the span once the request is parsed."""
    request = _request.get()
    span: Span | None = request.get(SPAN) if request is not None else None
    if span is None:
        return
    s = gen.sampling
    span.update_name(f"{GENERATION_PATHS[request.path]} {gen.model}")
    span.set_attributes({"strata.request_id": gen.request_id, telemetry.GEN_AI_REQUEST_MODEL: gen.model,
                         telemetry.GEN_AI_REQUEST_MAX_TOKENS: s.max_tokens, telemetry.GEN_AI_REQUEST_STREAM: stream})
    # What the client set; unset fields take the model's defaults in the engine.
    for attribute, value in ((telemetry.GEN_AI_REQUEST_TEMPERATURE, s.temperature),
                             (telemetry.GEN_AI_REQUEST_TOP_P, s.top_p), (telemetry.GEN_AI_REQUEST_SEED, s.seed)):
        if value is not None:
            span.set_attribute(attribute, value)
    if s.top_k is not None and s.top_k > 0:
        span.set_attribute(telemetry.GEN_AI_REQUEST_TOP_K, s.top_k)


def annotate_end_user(user: str) -> None:
    """OpenAI's `user` (the client's end user): on the request's log lines and its span."""
    structlog.contextvars.bind_contextvars(user=user)
    request = _request.get()
    span: Span | None = request.get(SPAN) if request is not None else None
    if span is not None:
        span.set_attribute(telemetry.USER_ID, user)


def annotate_response(response_id: str, model: str, final: TokenChunk, ttft: float,
                      timings: dict[str, float]) -> None:
    """What came back: usage, finish reason and where the time went, on the span (and the
    timings on the request's log line)."""
    request = _request.get()
    if request is None:
        return
    request[TIMINGS] = timings
    span: Span | None = request.get(SPAN)
    if span is None or not span.is_recording():
        return
    attributes = {telemetry.GEN_AI_RESPONSE_ID: response_id, telemetry.GEN_AI_RESPONSE_MODEL: model,
                  telemetry.GEN_AI_RESPONSE_FINISH_REASONS: [final.finish_reason or ""],
                  telemetry.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: ttft,
                  "strata.replica_id": final.replica_id or ""}
    if final.revision is not None:
        attributes["strata.revision"] = final.revision
    if final.usage is not None:
        attributes.update({telemetry.GEN_AI_USAGE_INPUT_TOKENS: final.usage.prompt_tokens,
                           telemetry.GEN_AI_USAGE_OUTPUT_TOKENS: final.usage.completion_tokens,
                           telemetry.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: final.usage.cached_tokens})
    attributes.update({f"strata.timing.{name}": seconds for name, seconds in timings.items()})
    span.set_attributes(attributes)

