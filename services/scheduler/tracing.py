"""The scheduler's span of each request: from receipt off the bus to the engine's acceptance.

It is a child of the caller's span (the gateway's, through the NATS headers) and the parent of
the engine's: the forward to the engine runs inside it. A request that waited for room gets an
`admission wait` child span. The routing decision is recorded on the span: the policy, every
candidate with its load, cached prefix and score, and the replica chosen.
"""

from __future__ import annotations

import contextlib

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from services.scheduler.policy import Decision
from shared import telemetry
from shared.protocol import GenerateRequest


class RoutingSpans:
    def __init__(self):
        self._spans: dict[str, Span] = {}  # request id -> open span, until routed or failed

    def begin(self, req: GenerateRequest) -> None:
        """Open the request's span under the current context (the caller's, from the headers)."""
        self._spans[req.request_id] = telemetry.tracer().start_span(
            f"route {req.model}", kind=SpanKind.CONSUMER,
            attributes={"strata.request_id": req.request_id, telemetry.GEN_AI_REQUEST_MODEL: req.model,
                        "messaging.system": "nats", "messaging.destination.name": "strata.v1.generate"})

    @contextlib.contextmanager
    def active(self, request_id: str):
        """Make the request's span current (so a publish carries it to the engine)."""
        span = self._spans.get(request_id)
        if span is None:
            yield
            return
        with trace.use_span(span, end_on_exit=False):
            yield

    def dequeued(self, req: GenerateRequest) -> None:
        span = self._spans.get(req.request_id)
        if span is None or not span.is_recording():
            return
        start = req.timestamps["scheduler_received"]
        end = req.timestamps["scheduler_dequeued"]
        span.set_attribute("strata.routing.queue_wait_s", end - start)
        telemetry.record_span("admission wait", start, end, telemetry.child_context(span))

    def decided(self, req: GenerateRequest, ranked: list[Decision], attempt: int, revision: int) -> None:
        span = self._spans.get(req.request_id)
        if span is None or not span.is_recording() or not ranked:
            return
        chosen = ranked[0]
        span.set_attributes({
            "strata.routing.policy": chosen.policy,
            "strata.routing.attempt": attempt,
            "strata.routing.revision": revision,  # 0: a replica not managed by control
            "strata.routing.candidates": [d.replica.replica_id for d in ranked],
            "strata.routing.candidate_loads": [d.replica.load for d in ranked],
            "strata.routing.candidate_cached_blocks": [d.cached_blocks for d in ranked],
            "strata.routing.prompt_blocks": chosen.prompt_blocks,
            "strata.routing.chosen": chosen.replica.replica_id,
        })
        if chosen.scores:  # kv_aware: each candidate's cost in blocks of prefill, lowest chosen
            span.set_attribute("strata.routing.scores", [chosen.scores[d.replica.replica_id] for d in ranked])

    def end(self, request_id: str, error_code: str | None = None, message: str = "") -> None:
        span = self._spans.pop(request_id, None)
        if span is None:
            return
        if error_code is not None:
            telemetry.mark_error(span, error_code, message)
        span.end()
