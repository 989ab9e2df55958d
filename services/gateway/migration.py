"""Mid-stream migration: a request whose engine replica dies continues on another replica.

A request the gateway serves is a flow (services.gateway.flow) of one or more legs. A leg is one
engine's run of it, with its own request id on the bus (the original id, then `<id>-m1`,
`<id>-m2`) and the request's reply subject. The gateway learns a leg's replica from the engine's
acceptance notice (`<reply_to>.accepted`) or from its chunks, and watches every replica's
heartbeats. When a leg's replica falls silent, its stream loses a chunk, or it drains away from
the request, the gateway cancels that leg (a replica presumed dead may be alive) and submits the
next one: the original prompt followed by every completion token delivered so far, the same
sampling (the original max_tokens: the engine counts the delivered tokens, `resume.generated`,
against it), and `resume` set, so the engine continues exactly where the client is (greedy and
seeded output are the same as without the fault). Chunks of earlier legs are dropped. Past
MAX_MIGRATIONS, or when no replica takes it, the stream ends with an in-band error; so does a
stream of several choices (n > 1), at once (each prompt of a batch is a flow of its own, and
migrates as one).

A replica is presumed dead only on evidence that holds under overload: its heartbeats (sent from
a thread that never waits on a step) stopped AND the stream itself got nothing for as long; or
its heartbeats go on while its step count stands still and the stream gets nothing (a stalled
engine). While this gateway's own loop runs late, or heartbeats wait unread in its subscription,
silence proves nothing and no verdict is given. Migrations are rate limited (a token bucket), so a
burst of them cannot re-run prompts all at once on replicas that are already the busiest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from prometheus_client import Counter

from services.gateway.flow import Flow, FlowTable
from services.gateway.openai_api import ApiError
from shared import protocol
from shared.logging import get_logger
from shared.protocol import (
    Cancel,
    ErrorCode,
    ErrorInfo,
    GenerateAck,
    GenerateRequest,
    Heartbeat,
    Resume,
    TokenChunk,
)

log = get_logger()

MAX_MIGRATIONS = 2
REPLICA_DEAD_AFTER = 3.0  # seconds without a heartbeat (three missed beats) before a replica is presumed dead
REPLICA_STALLED_AFTER = 20.0  # seconds its heartbeats show work but no engine step
LOOP_LAG_TOLERANCE = 1.0  # the watcher woke this much later than asked: this loop is the slow one
MIGRATIONS_PER_S = 5.0  # the migration token bucket: refill rate and burst
MIGRATION_BURST = 20
# After a NATS outage, a stream that gets no chunk for this long has lost its tail (its replica
# may have finished it while nobody could hear): it resumes from what was delivered.
STALLED_AFTER_RECONNECT = 2.0
WATCH_INTERVAL = 0.25


@dataclass
class ReplicaLiveness:
    """What the heartbeats of one replica showed: when it last beat, and when its engine last
    took a step (or had nothing to do)."""

    seen: float
    steps: int = 0
    stepped: float = 0.0

    def beat(self, hb: Heartbeat, now: float) -> None:
        if hb.steps_total != self.steps or not (hb.running or hb.waiting):
            self.stepped = now
        self.seen, self.steps = now, hb.steps_total


class TokenBucket:
    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.at = time.monotonic()

    def delay(self) -> float:
        """Take a token; seconds to wait for it (0: one was there)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= 1
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class Migrator:
    """The gateway's side of migration: replica liveness, the verdicts, the next leg's submission.

    What it needs of the gateway is all it is given: the table of open flows (their state is
    shared: the gateway reads their chunks, this moves their legs), `submit(flow, leg)` to hand a
    leg to a scheduler (raises ApiError when none takes it), the metrics registry, and at start
    the bus and the heartbeat subscription (its backlog: heartbeats not read yet)."""

    def __init__(self, flows: FlowTable, submit: Callable[[Flow, GenerateRequest], Awaitable[None]], registry):
        self.flows = flows
        self.submit = submit
        self.bus = None
        self.replicas: dict[str, ReplicaLiveness] = {}  # replica id -> what its heartbeats showed
        self._blind_until = 0.0  # after a NATS outage or a late loop, silence says nothing about the replicas
        self._heartbeats = None  # the heartbeat subscription (its backlog: heartbeats not read yet)
        self.bucket = TokenBucket(MIGRATIONS_PER_S, MIGRATION_BURST)
        self._reconnects = 0
        self._suspects: dict[str, tuple[str, int]] = {}  # request id -> (leg, seq) when the bus came back
        self._suspects_due = 0.0
        self._tasks: set[asyncio.Task] = set()
        self._watch: asyncio.Task | None = None
        self.migrations = Counter("strata:gateway_migrations",
                                  "Streams moved to another replica (migrated) or ended because they could not be "
                                  "(failed), by reason.", ["outcome", "reason"], registry=registry)
        self.verdicts = Counter("strata:gateway_replica_dead_verdicts",
                                "Replicas this gateway presumed dead or stalled (each moves the streams it held), by "
                                "reason.", ["reason"], registry=registry)

    def start(self, bus, heartbeats) -> None:
        self.bus, self._heartbeats = bus, heartbeats
        self._watch = asyncio.create_task(self._watch_replicas())

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    # ---- flows ------------------------------------------------------------------------------
    def accept(self, flow: Flow, chunk: TokenChunk) -> TokenChunk | None:
        """The chunk to deliver to the client, or None: it belongs to an earlier leg, repeats one
        already delivered, or shows the leg is lost (then the next leg is on its way)."""
        if chunk.seq < 0:  # the gateway's own final error (deadline, dead scheduler, failed migration)
            return chunk
        if chunk.request_id != flow.leg_id or chunk.seq < flow.expected_seq:
            return None
        if flow.replica is not None and chunk.replica_id is not None and chunk.replica_id != flow.replica:
            return None  # a late run of this leg on a replica its scheduler withdrew it from
        if chunk.seq > flow.expected_seq:
            self._spawn_migrate(flow, "lost_chunk", f"stream message {flow.expected_seq} from replica "
                                                   f"{chunk.replica_id} was lost")
            return None
        if chunk.error is not None and chunk.error.code == ErrorCode.UNAVAILABLE and chunk.replica_id is not None:
            self._spawn_migrate(flow, "replica_left", chunk.error.message)  # the replica drained away from it
            return None
        flow.expected_seq += 1
        flow.last_progress = time.monotonic()
        flow.replica = chunk.replica_id or flow.replica
        flow.held_by = None  # an engine has it (its routing notice may be lost)
        flow.token_ids += chunk.token_ids
        flow.text_chars += len(chunk.text)
        return chunk

    # ---- replicas ---------------------------------------------------------------------------
    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        replica = self.replicas.get(hb.replica_id)
        if replica is None:
            replica = self.replicas[hb.replica_id] = ReplicaLiveness(now, hb.steps_total, now)
        replica.beat(hb, now)

    def on_accepted(self, flow: Flow, data: bytes) -> None:
        """An engine took a leg of the request (`<reply_to>.accepted`): that is the replica to
        watch, and the only one whose chunks count; no scheduler holds the leg any more. A notice
        that it is withdrawn (its scheduler gave the leg to another replica) frees the leg for
        that other one."""
        try:
            ack = protocol.decode(GenerateAck, data)
        except protocol.ProtocolError as exc:
            log.warning("malformed acceptance notice", error=str(exc))
            return
        if ack.request_id != flow.leg_id:  # an earlier leg's
            return
        if not ack.accepted:
            if flow.replica == ack.replica_id:
                flow.replica = None
            return
        flow.at_engine, flow.held_by = True, None
        if flow.replica is not None and flow.replica != ack.replica_id:  # a withdrawn run, taken late
            log.info("late acceptance ignored", request_id=flow.request_id, replica_id=ack.replica_id,
                     serving=flow.replica)
            return
        now = time.monotonic()
        flow.replica, flow.last_progress = ack.replica_id, now
        self.replicas.setdefault(ack.replica_id, ReplicaLiveness(now, 0, now))

    async def _watch_replicas(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            now = time.monotonic()
            late = now - last > WATCH_INTERVAL + LOOP_LAG_TOLERANCE
            backlog = self._heartbeats is not None and self._heartbeats.pending_msgs > 0
            last = now
            if not self.bus.nc.is_connected or late or backlog:
                self._blind_until = max(self._blind_until, now + (REPLICA_DEAD_AFTER if not backlog else 0.0))
            self._check_stalled(now)
            if now < self._blind_until or backlog:
                continue
            self.judge(now)
            for replica_id, replica in list(self.replicas.items()):
                if now - replica.seen > 300:  # long gone: forget it
                    del self.replicas[replica_id]

    def judge(self, now: float) -> None:
        """Move the streams of replicas that are dead or stalled by the evidence (module doc)."""
        verdicts: dict[str, tuple[str, str]] = {}
        for flow in self.flows:
            replica_id = flow.replica
            if replica_id is None or flow.migrating:
                continue
            replica = self.replicas.setdefault(replica_id, ReplicaLiveness(now, 0, now))  # not heard yet: from now
            quiet = now - flow.last_progress
            if now - replica.seen > REPLICA_DEAD_AFTER and quiet > REPLICA_DEAD_AFTER:
                verdict = ("replica_silent", f"replica {replica_id} sent no heartbeat for {now - replica.seen:.1f}s")
            elif now - replica.stepped > REPLICA_STALLED_AFTER and quiet > REPLICA_STALLED_AFTER:
                verdict = ("replica_stalled", f"replica {replica_id} took no engine step for "
                                              f"{now - replica.stepped:.1f}s while it held work")
            else:
                continue
            if replica_id not in verdicts:
                verdicts[replica_id] = verdict
                self.verdicts.labels(verdict[0]).inc()
                log.warning("replica presumed lost", replica_id=replica_id, reason=verdict[1])
            self._spawn_migrate(flow, *verdicts[replica_id])

    def _check_stalled(self, now: float) -> None:
        """Chunks published while the bus was away are lost for good: a stream that was on a
        replica when it came back and has had no chunk since resumes elsewhere."""
        reconnects = self.bus.nc.stats["reconnects"]
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            self._suspects = {f.request_id: (f.leg_id, f.expected_seq) for f in self.flows if f.replica}
            self._suspects_due = now + STALLED_AFTER_RECONNECT
            return
        if not self._suspects or now < self._suspects_due:
            return
        for rid, progress in self._suspects.items():
            flow = self.flows.get(rid)
            if flow is not None and not flow.migrating and (flow.leg_id, flow.expected_seq) == progress:
                self._spawn_migrate(flow, "bus_outage", "no stream message since the bus reconnected")
        self._suspects = {}

    # ---- the next leg -----------------------------------------------------------------------
    def _spawn_migrate(self, flow: Flow, reason: str, detail: str) -> None:
        lost_leg, flow.leg_id = flow.leg_id, ""  # nothing more of it is delivered
        flow.migrating = True
        task = asyncio.create_task(self._migrate(flow, lost_leg, reason, detail))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _migrate(self, flow: Flow, lost_leg: str, reason: str, detail: str) -> None:
        gen, rid = flow.gen, flow.gen.request_id
        try:
            await self.bus.publish(protocol.CANCEL, Cancel(request_id=lost_leg, tenant=gen.tenant))
            remaining = gen.sampling.max_tokens - flow.completion_tokens
            if gen.sampling.n > 1:  # a Resume continues one completion; the choices' would need one each
                return self._fail(flow, reason, ErrorCode.UNAVAILABLE, f"{detail}; a stream of {gen.sampling.n} "
                                  f"choices (n > 1) does not move to another replica")
            if flow.migrations >= MAX_MIGRATIONS:
                return self._fail(flow, reason, ErrorCode.UNAVAILABLE, f"{detail}; the stream already moved "
                                  f"{flow.migrations} times, the most it may")
            # A prefill-only request (max_tokens 0, for its prompt logprobs) that streamed nothing yet runs again.
            least = 0 if gen.sampling.prompt_logprobs is not None and flow.expected_seq == 0 else 1
            if remaining < least or (gen.deadline is not None and gen.deadline <= time.time()):
                return self._fail(flow, reason, ErrorCode.UNAVAILABLE, f"{detail}; nothing is left to continue")
            wait = self.bucket.delay()  # a burst of migrations waits its turn
            if gen.deadline is not None and time.time() + wait >= gen.deadline:
                return self._fail(flow, reason, ErrorCode.UNAVAILABLE, f"{detail}; no time is left to continue "
                                  f"(migrations are rate limited)")
            if wait > 0:
                self.migrations.labels("delayed", reason).inc()
                await asyncio.sleep(wait)
            if flow.closed:
                return
            flow.migrations += 1
            # The same sampling, max_tokens included: the engine counts resume.generated against it.
            leg = msgspec.structs.replace(
                gen, request_id=f"{rid}-m{flow.migrations}", prompt_token_ids=gen.prompt_token_ids + flow.token_ids,
                timestamps=dict(gen.timestamps),
                resume=Resume(request_id=rid, generated=flow.completion_tokens, text_chars=flow.text_chars,
                              replica_id=flow.replica, attempt=flow.migrations))
            log.warning("stream migrating", request_id=rid, leg=leg.request_id, replica_id=flow.replica,
                        delivered_tokens=flow.completion_tokens, reason=detail)
            self.flows.start_leg(flow, leg.request_id)
            try:
                await self.submit(flow, leg)
            except ApiError as exc:
                return self._fail(flow, reason, ErrorCode.UNAVAILABLE, f"{detail}; no replica could take the rest "
                                  f"of the stream: {exc.message}")
            self.migrations.labels("migrated", reason).inc()
            if flow.closed:  # the client left meanwhile
                await self.bus.publish(protocol.CANCEL, Cancel(request_id=leg.request_id, tenant=gen.tenant))
        except Exception as exc:  # NATS away, ...: the client still gets a final message
            log.exception("migration failed", request_id=rid)
            self._fail(flow, reason, ErrorCode.UNAVAILABLE, f"{detail}; migration failed: {exc.__class__.__name__}")
        finally:
            flow.migrating = False

    def _fail(self, flow: Flow, reason: str, code: str, message: str) -> None:
        flow.leg_id = ""  # whatever still comes from the bus: this error is the end
        self.migrations.labels("failed", reason).inc()
        log.warning("stream lost", request_id=flow.gen.request_id, reason=message)
        flow.queue.put_nowait(TokenChunk(request_id=flow.gen.request_id, seq=-1, finish_reason="error",
                                         error=ErrorInfo(code=code, message=message)))
