"""A finished request, seen from the engine: its hop timestamps and its spans.

The engine keeps monotonic times per sequence; the hop timestamps (shared.layers) are unix
seconds. Both clocks are read together when the request arrives (`engine_received` and the
sink's arrival), so the sequence's times convert by that one offset.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from services.engine.outputs import RequestMetrics
from shared import telemetry


def engine_stamps(received: float, arrival: float, metrics: RequestMetrics | None) -> dict[str, float]:
    """engine_scheduled / engine_first_token / engine_finished (unix seconds) of a finished
    request; `received` and `arrival` are its arrival on the wall and monotonic clocks."""
    out: dict[str, float] = {}
    if metrics is None:
        return out
    for name, t in (("engine_scheduled", metrics.first_scheduled_time),
                    ("engine_first_token", metrics.first_token_time), ("engine_finished", metrics.finish_time)):
        if t is not None:
            out[name] = received + (t - arrival)
    return out


def record_spans(parent: otel_context.Context, model: str, request_id: str, replica_id: str,
                 stamps: dict[str, float], attributes: dict, error: str | None = None) -> None:
    """The engine's span of one request (arrival to final chunk) with its phases as children:
    queue (arrival to first schedule), prefill (to the first token), decode (to the finish)."""
    if not telemetry.enabled():
        return
    received = stamps["engine_received"]
    end = stamps.get("engine_final_chunk", received)
    span = telemetry.record_span(
        f"generate {model}", received, end, parent, SpanKind.CONSUMER,
        {"strata.request_id": request_id, "strata.replica_id": replica_id,
         telemetry.GEN_AI_REQUEST_MODEL: model, **attributes}, error)
    inner = telemetry.child_context(span)
    start = received
    for name, stamp in (("engine.queue", "engine_scheduled"), ("engine.prefill", "engine_first_token"),
                        ("engine.decode", "engine_finished")):
        if stamp not in stamps:
            break
        telemetry.record_span(name, start, stamps[stamp], inner)
        start = stamps[stamp]
