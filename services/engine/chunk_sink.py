"""One request's stream at the engine worker: the engine's outputs turned into TokenChunks, and
the one final message every request ends in.

The sink knows its worker only through a `StreamContext` (the replica's names, its metrics, the
outbox, and two calls: abort a request, and "this stream has ended"); the worker knows a sink
through `withdraw()`, `shut_down()` and `req`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import context as otel_context

from services.engine.engine_client import EngineDeadError
from services.engine.metrics import EngineMetrics
from services.engine.observe import engine_stamps, record_spans
from services.engine.outbox import Outbox
from services.engine.outputs import RequestOutput
from shared import protocol, telemetry
from shared.logging import get_logger
from shared.protocol import (ErrorCode, ErrorInfo, GenerateAck, GenerateRequest, SpecDecodeUsage, TokenChunk,
                             TokenLogprob, Usage)

log = get_logger()


@dataclass(frozen=True)
class StreamContext:
    """What a stream needs from its worker."""

    replica_id: str
    revision: int
    metrics: EngineMetrics
    outbox: Outbox
    abort: Callable[[str], None]  # abort a request in the engine: its stream gets a last output
    on_end: Callable[["ChunkSink"], None]  # the stream has sent its final message


class ChunkSink:
    """One request's outputs turned into TokenChunks on the event loop, as the engine delivers
    them (one per request per step): no task per request."""

    def __init__(self, ctx: StreamContext, req: GenerateRequest, arrival: float):
        self.ctx, self.req, self.arrival = ctx, req, arrival
        self.trace_parent = otel_context.get_current()  # the sender's span, from the message headers
        self.seq_no = 0
        self.last_emit: float | None = None
        self.expired = False  # its deadline passed: it ends with a deadline error
        self.withdrawn = False  # its scheduler gave it to another replica: the caller follows that one
        self.shutting_down = False  # aborted by a drain past its timeout: it ends as `unavailable`
        self.timer: asyncio.TimerHandle | None = None
        self.final_sent = False  # its one final message is in the outbox
        self.ended = False

    # ---- what the worker calls --------------------------------------------------------------
    def start_deadline(self) -> None:
        """One timer per request: at the deadline the engine aborts it, and the stream ends with
        a deadline error."""
        if self.req.deadline is not None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_at(loop.time() + max(self.req.deadline - time.time(), 0.0), self._on_deadline)

    def withdraw(self) -> None:
        """Cancelled by name for this replica: another one serves the caller."""
        self.withdrawn = True
        self.ctx.abort(self.req.request_id)

    def shut_down(self) -> None:
        """The replica stops before the request finished."""
        self.shutting_down = True
        self.ctx.abort(self.req.request_id)

    # ---- what the engine calls (RequestSink) ------------------------------------------------
    def deliver(self, out: RequestOutput) -> None:
        req = self.req
        if self.ended:  # e.g. the abort's output after a failure here already ended it
            return
        if self.withdrawn:
            if out.finished:
                self._observe(out, ErrorCode.CANCELLED)
                self._end(self._send_withdrawn)
            return
        try:
            if out.finished and self.expired:
                self._observe(out, ErrorCode.DEADLINE_EXCEEDED)
                return self._end(lambda: self._send_error(ErrorCode.DEADLINE_EXCEEDED, "request deadline exceeded"))
            if out.finished and self.shutting_down:
                self._observe(out, ErrorCode.UNAVAILABLE)
                return self._end(lambda: self._send_error(ErrorCode.UNAVAILABLE,
                                                          "the replica shut down before the request finished"))
            chunk = self._chunk(out)
            now = time.monotonic()
            if chunk.token_ids:
                if self.last_emit is None:
                    self.ctx.metrics.first_token(now - self.arrival)
                else:
                    self.ctx.metrics.token_gap((now - self.last_emit) / len(chunk.token_ids))
                self.last_emit = now
            if chunk.is_final:
                chunk.timestamps = self._stamps(out)
            self.ctx.outbox.send_chunk(req, chunk)
            self.seq_no += 1
            if chunk.is_final:
                self.final_sent = True
                self._observe(out, None, chunk.timestamps)
                self._end(lambda: self._record_final(out))
        except Exception:  # never leave the caller without a final message
            log.exception("stream failed", request_id=req.request_id)
            self.ctx.abort(req.request_id)
            self._end(lambda: None if self.final_sent else
                      self._send_error(ErrorCode.INTERNAL, "internal error in the engine worker"))

    def fail(self, exc: BaseException) -> None:
        # A dead engine is this replica's loss, not the request's: `unavailable` (with the
        # replica id) has the gateway continue the stream on another replica.
        code = ErrorCode.UNAVAILABLE if isinstance(exc, EngineDeadError) else ErrorCode.INTERNAL
        self._observe(None, code)
        self._end(lambda: self._send_error(code, str(exc)))

    # ---- the messages ---------------------------------------------------------------------
    def _chunk(self, last: RequestOutput) -> TokenChunk:
        req, seq_no = self.req, self.seq_no
        chunk = TokenChunk(request_id=req.request_id, seq=seq_no, token_ids=last.new_token_ids, text=last.text_delta,
                           replica_id=self.ctx.replica_id)
        if req.sampling.logprobs is not None:
            chunk.logprobs = [TokenLogprob(token_id=t, logprob=lp, top=top) for t, lp, top in last.new_logprobs]
        if seq_no == 0 and last.prompt_logprobs is not None:
            chunk.prompt_logprobs = [TokenLogprob(token_id=e.token_id, logprob=e.logprob, top=e.top, rank=e.rank)
                                     for e in last.prompt_logprobs]
        completion = last.outputs[0]
        chunk.index, chunk.choices_running = completion.index, last.choices_running
        chunk.finish_reason = completion.finish_reason  # set on each choice's last output
        if last.finished:
            chunk.usage = Usage(prompt_tokens=len(last.prompt_token_ids),
                                completion_tokens=last.num_completion_tokens, cached_tokens=last.num_cached_tokens)
            chunk.timings = {f"engine_{k}": v for k, v in last.metrics.timings().items()}
            if last.metrics.num_draft_tokens:
                chunk.spec_decode = SpecDecodeUsage(draft_tokens=last.metrics.num_draft_tokens,
                                                    accepted_tokens=last.metrics.num_accepted_tokens)
            chunk.revision = self.ctx.revision or None
        return chunk

    def _send_error(self, code: str, message: str) -> None:
        self.ctx.metrics.finished("error")
        self.ctx.outbox.send_chunk(self.req, TokenChunk(
            request_id=self.req.request_id, seq=self.seq_no, finish_reason="error",
            error=ErrorInfo(code=code, message=message), replica_id=self.ctx.replica_id,
            revision=self.ctx.revision or None))

    def _send_withdrawn(self) -> None:
        """This replica's run of a request is off (its scheduler gave up waiting for it and gave it
        to another): the caller is told on `<reply_to>.accepted`, so it follows the other run; a run
        that had already streamed also ends in band as `unavailable`, and the caller continues it
        from what it got. Not an error of this replica's: counted as an abort."""
        req, ctx = self.req, self.ctx
        ctx.metrics.finished("abort")
        ctx.outbox.send(protocol.accepted(req.reply_to), GenerateAck(
            req.request_id, ctx.replica_id, False, ErrorInfo(code=ErrorCode.UNAVAILABLE, message="withdrawn")))
        if self.seq_no:
            ctx.outbox.send_chunk(req, TokenChunk(
                request_id=req.request_id, seq=self.seq_no, finish_reason="error", replica_id=ctx.replica_id,
                error=ErrorInfo(code=ErrorCode.UNAVAILABLE, message="withdrawn by its scheduler: continue elsewhere")))

    def _record_final(self, out: RequestOutput) -> None:
        m = self.ctx.metrics
        m.finished(out.outputs[0].finish_reason or "unknown")
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(out.num_completion_tokens)
        m.e2e.observe(time.monotonic() - self.arrival)
        t = out.metrics.timings()
        for key, hist in (("queue", m.queue_time), ("prefill", m.prefill_time), ("decode", m.decode_time)):
            if key in t:
                hist.observe(t[key])

    # ---- the end ----------------------------------------------------------------------------
    def _on_deadline(self) -> None:
        self.expired = True
        self.ctx.abort(self.req.request_id)

    def _stamps(self, out: RequestOutput | None) -> dict[str, float]:
        """The request's hop timestamps, the engine's own added (shared.layers)."""
        received = self.req.timestamps.get("engine_received", time.time())
        return {**self.req.timestamps, **engine_stamps(received, self.arrival, out.metrics if out else None),
                "engine_final_chunk": time.time()}

    def _observe(self, out: RequestOutput | None, error: str | None, stamps: dict | None = None) -> None:
        """The finished request's spans and its one log line."""
        stamps = stamps or self._stamps(out)
        fields = {"finish_reason": out.outputs[0].finish_reason if out else None, "error": error,
                  "revision": self.ctx.revision}
        attributes = {"strata.revision": self.ctx.revision}
        if out is not None:
            attributes |= {telemetry.GEN_AI_USAGE_INPUT_TOKENS: len(out.prompt_token_ids),
                           telemetry.GEN_AI_USAGE_OUTPUT_TOKENS: out.num_completion_tokens,
                           telemetry.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: out.num_cached_tokens,
                           telemetry.GEN_AI_RESPONSE_FINISH_REASONS: [error or out.outputs[0].finish_reason or ""]}
            fields.update(prompt_tokens=len(out.prompt_token_ids), completion_tokens=out.num_completion_tokens,
                          cached_tokens=out.num_cached_tokens,
                          **{f"{k}_ms": round(v * 1e3, 3) for k, v in out.metrics.timings().items()})
        record_spans(self.trace_parent, self.req.model, self.req.request_id, self.ctx.replica_id, stamps,
                     attributes, error)
        log.info("request finished", request_id=self.req.request_id, **fields)

    def _end(self, final: Callable[[], None]) -> None:
        """Once: the final message (unless one went out already), and the worker is told."""
        if self.ended:
            return
        self.ended = True
        if self.timer is not None:
            self.timer.cancel()
        try:
            final()
        finally:
            self.ctx.on_end(self)
