"""The engine worker: one engine on the bus.

Wires NATS subscriptions to handlers: generate requests stream TokenChunks (services.engine.
chunk_sink) through one outbox (services.engine.outbox): to the caller's reply subject, or, for a
gateway that names `batch_to`, in one TokenChunkBatch per step with its other requests; cancels
abort; KV events and heartbeats go out. Heartbeats and the Redis registry lease come from a thread
of their own (services.engine.heartbeats), from the moment the process is on the bus: `starting`
while the model loads (so requests for it wait instead of being refused), then `ready`; they
advertise the engine's effective max_model_len and vocab_size. With enable_lora, the adapters
registered for its deployment (shared.adapters) are served: registered and unregistered as
announced. SIGTERM drains: no new work, in-flight streams finish (up to a timeout), the entry is
removed, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from aiohttp import web

from services.engine.async_engine import AsyncLLMEngine
from services.engine.block_manager import KvEvents
from services.engine.chunk_sink import ChunkSink, StreamContext
from services.engine.config import EngineArgs
from services.engine.core_client import CoreClient
from services.engine.engine_client import EngineDeadError
from services.engine.heartbeats import HeartbeatThread
from services.engine.llm_engine import LLMEngine
from services.engine.lora import LoRAAdapterError
from services.engine.metrics import EngineMetrics
from services.engine.outbox import Outbox
from services.engine.sampling_params import InvalidRequestError
from shared import adapters, http, protocol, registry
from shared.bus import Bus, NatsAuth
from shared.logging import get_logger
from shared.metrics_history import MetricsHistory, metrics_response
from shared.protocol import (Cancel, ErrorCode, ErrorInfo, GenerateAck, GenerateRequest, Heartbeat,
                             KvBlockStored, KvEventBatch, KvSnapshot, KvSnapshotRequest, LoraAdaptersChanged,
                             TokenChunk)
from shared.store import connect_redis

log = get_logger()


@dataclass
class WorkerConfig:
    model_dir: str
    replica_id: str
    deployment: str
    nats_url: str
    redis_url: str
    http_host: str = "127.0.0.1"
    http_port: int = 0
    lease_ttl: float = 5.0
    heartbeat_interval: float = 1.0
    drain_timeout: float = 30.0
    engine_args: dict = field(default_factory=dict)
    revision: int = 0
    region: str = ""  # where it runs, and the capacity pool that started it (reported in heartbeats)
    pool: str = ""
    nats_auth: NatsAuth = field(default_factory=NatsAuth)


class EngineWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.state = "starting"
        self.engine: AsyncLLMEngine | CoreClient | None = None
        self.bus: Bus | None = None
        self.redis = None
        self.metrics = EngineMetrics(cfg.deployment, cfg.replica_id)
        self.history = MetricsHistory(self.metrics.registry)
        self.http_url = ""
        self._streams: dict[str, ChunkSink] = {}  # accepted requests until their final message
        self._tasks: set[asyncio.Task] = set()
        self._kv_queue: asyncio.Queue[tuple[int, KvEvents]] = asyncio.Queue()
        self.outbox = Outbox(lambda subject, payload: self.bus.publish(subject, payload), cfg.replica_id)
        self._stream_context = StreamContext(cfg.replica_id, cfg.revision, self.metrics, self.outbox,
                                             abort=lambda request_id: self.engine.abort(request_id),
                                             on_end=self._stream_ended)
        self.epoch = uuid.uuid4().hex[:12]  # KV event numbering restarts with the process
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._last_tokens = (time.monotonic(), 0)
        self._last_heartbeat = 0.0
        self._tokens_per_s = 0.0
        self.exit_code = 0
        self._early_cancels: dict[str, tuple[float, str | None]] = {}
        self._accepted_total = 0
        self._latency: tuple[float | None, float | None] = (None, None)  # recent TTFT p90, ITL p50
        self.heartbeats: HeartbeatThread | None = None
        self.ready_at = 0.0  # unix seconds

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        structlog.contextvars.bind_contextvars(replica_id=cfg.replica_id)
        args = EngineArgs.from_kwargs(**cfg.engine_args)
        self.bus = await Bus.connect(cfg.nats_url, f"engine-{cfg.replica_id}", auth=cfg.nats_auth)
        self.redis = connect_redis(cfg.redis_url, f"engine-{cfg.replica_id}")
        # On the bus as `starting` before the model loads: requests for it wait for it.
        self.heartbeats = HeartbeatThread(f"engine-{cfg.replica_id}", cfg.nats_url, cfg.nats_auth, cfg.redis_url,
                                          cfg.heartbeat_interval, cfg.lease_ttl, self.heartbeat, self._registry_fields)
        self.heartbeats.start()
        on_kv_events = lambda seq, events: self._kv_queue.put_nowait((seq, events))  # noqa: E731
        if args.engine_core == "process":
            self.engine = CoreClient(cfg.model_dir, args, on_kv_events=on_kv_events, on_step=self.metrics.observe_step)
        else:
            self.engine = AsyncLLMEngine(lambda: LLMEngine(cfg.model_dir, args), on_kv_events=on_kv_events,
                                         on_step=self.metrics.observe_step)
        try:
            await self.engine.start()
        except BaseException:  # no model: leave the fleet at once, not when the lease runs out
            await asyncio.get_running_loop().run_in_executor(None, self.heartbeats.stop)
            await registry.remove(self.redis, cfg.replica_id, cfg.deployment)
            raise
        await self._start_http()
        await self.bus.subscribe(protocol.engine_generate(cfg.replica_id), GenerateRequest, self.on_generate)
        await self.bus.subscribe(protocol.CANCEL, Cancel, self.on_cancel)
        await self.bus.subscribe(protocol.engine_kv_snapshot(cfg.replica_id), KvSnapshotRequest, self.on_kv_snapshot)
        if self.engine.adapters is not None:
            await self.bus.subscribe(protocol.lora_adapters(cfg.deployment), LoraAdaptersChanged, self.on_adapters)
            await self.sync_adapters()
            self._spawn(self._adapter_sync_loop())
        self._spawn(self._publish_kv_events())
        self._spawn(self.outbox.run())
        self._spawn(self.history.run())
        self.state, self.ready_at = "ready", time.time()
        await self._heartbeat_once()
        self._spawn(self._heartbeat_loop())
        log.info("engine ready", model=cfg.model_dir, deployment=cfg.deployment, http=self.http_url,
                 kv_blocks=self.engine.limits.num_kv_blocks, block_size=args.block_size, engine_core=args.engine_core)

    async def _start_http(self) -> None:
        self._runner, self.http_url = await http.serve(
            {"/metrics": self._http_metrics, "/health": self._http_health}, self.cfg.http_host, self.cfg.http_port)

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain and stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self._stopping.wait()
        await self.drain()

    async def drain(self) -> None:
        """Stop taking work, let in-flight streams finish (up to drain_timeout), deregister."""
        if self.state != "failed":
            self.state = "draining"
        log.info("draining", in_flight=self.engine.num_open_streams)
        await self._heartbeat_once()
        deadline = time.monotonic() + self.cfg.drain_timeout
        while self.engine.num_open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for sink in list(self._streams.values()):
            sink.shut_down()  # past the timeout: they end with an `unavailable` error
        deadline = time.monotonic() + 5
        while self._streams and time.monotonic() < deadline:  # the aborts' final chunks are made
            await asyncio.sleep(0.02)
        await self.stop()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.heartbeats is not None:  # before deregistering: no beat may register it again
            await asyncio.get_running_loop().run_in_executor(None, self.heartbeats.stop)
        await self.outbox.flush()  # chunks the publisher had not sent yet
        try:
            await registry.remove(self.redis, self.cfg.replica_id, self.cfg.deployment)
        except Exception as exc:
            log.warning("deregister failed", error=str(exc))
        await self.engine.shutdown()
        await self.bus.close()
        await self.redis.aclose()
        if self._runner is not None:
            await self._runner.cleanup()
        log.info("engine stopped")

    def _spawn(self, coro, name: str = "") -> asyncio.Task:
        task = asyncio.create_task(coro, name=name or None)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- generate ---------------------------------------------------------------------------
    async def on_generate(self, req: GenerateRequest, raw) -> None:
        arrival = time.monotonic()
        req.timestamps["engine_received"] = time.time()
        if self.state != "ready":
            await self._refuse(req, raw, ErrorCode.UNAVAILABLE, f"replica {self.cfg.replica_id} is {self.state}")
            return
        self.metrics.arrived(req.timestamps, self.ready_at)
        if req.deadline is not None and req.deadline <= time.time():
            await self._refuse(req, raw, ErrorCode.DEADLINE_EXCEEDED, "deadline passed before the request arrived")
            return
        if req.accept_by is not None and req.accept_by < time.time():  # its sender already tries another replica
            await self._refuse(req, raw, ErrorCode.UNAVAILABLE, "the request arrived after its sender stopped waiting")
            return
        early = self._early_cancels.pop(req.request_id, None)
        if early is not None and early[1] == req.tenant:
            await self._refuse(req, raw, ErrorCode.CANCELLED, "the request was cancelled before it arrived")
            return
        prompt = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
        error = await self._context_error(req)
        if error is not None:
            await self._refuse(req, raw, ErrorCode.BAD_REQUEST, error)
            return
        if req.lora is not None and not await self._adapter_ready(req, raw):
            return
        if req.sampling.structured is not None and not await self._grammar_ready(req, raw):
            return
        sink = ChunkSink(self._stream_context, req, arrival)
        try:
            resumed = (req.resume.generated, req.resume.text_chars) if req.resume is not None else (0, 0)
            self.engine.add_request(req.request_id, prompt, req.sampling, arrival, sink=sink,
                                    resumed=resumed, lora_name=req.lora)
        except InvalidRequestError as exc:
            await self._refuse(req, raw, ErrorCode.BAD_REQUEST, str(exc))
            return
        except EngineDeadError as exc:
            await self._refuse(req, raw, ErrorCode.UNAVAILABLE, str(exc))
            return
        self._streams[req.request_id] = sink
        self._accepted_total += 1
        sink.start_deadline()
        ack = GenerateAck(req.request_id, self.cfg.replica_id, True, accepted_seq=self._accepted_total)
        if raw.reply:
            await self.bus.publish(raw.reply, ack)
        await self.bus.publish(protocol.accepted(req.reply_to), ack)

    async def _grammar_ready(self, req: GenerateRequest, raw) -> bool:
        """The request's structured-output grammar compiled (off the event loop and the step loop;
        cached, so add_request finds it); a spec that does not compile refuses the request."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.compile_grammar,
                                                             req.sampling.structured)
        except InvalidRequestError as exc:
            await self._refuse(req, raw, ErrorCode.BAD_REQUEST, str(exc))
            return False
        return True

    async def _context_error(self, req: GenerateRequest) -> str | None:
        """Why the prompt and max_tokens do not fit this model's context, if they do not (a text
        prompt is tokenized for it; the engine tokenizes it again, as it always does)."""
        engine = self.engine
        if req.prompt_token_ids is not None:
            prompt_len = len(req.prompt_token_ids)
        elif len(req.prompt) > 16_384:
            prompt_len = len(await asyncio.get_running_loop().run_in_executor(None, engine.encode, req.prompt))
        else:
            prompt_len = len(engine.encode(req.prompt))
        prompt_len -= req.resume.generated if req.resume is not None else 0  # max_tokens counts those
        max_model_len = engine.limits.max_model_len
        if prompt_len + req.sampling.max_tokens <= max_model_len:
            return None
        return (f"this model's maximum context length is {max_model_len} tokens: a prompt of {prompt_len} "
                f"and max_tokens {req.sampling.max_tokens} do not fit")
    async def _adapter_ready(self, req: GenerateRequest, raw) -> bool:
        """The request's adapter is served here and in the host cache (read from disk off the
        event loop and off the step loop); otherwise the request is refused."""
        lora = self.engine.adapters
        if lora is None:
            await self._refuse(req, raw, ErrorCode.BAD_REQUEST, f"LoRA adapter {req.lora!r} requested, but "
                                                                 f"{self.cfg.deployment} serves no adapters (enable_lora)")
            return False
        if lora.path_of(req.lora) is None:
            await self.sync_adapters()  # loaded a moment ago: the announcement may still be on its way
        if lora.path_of(req.lora) is None:
            await self._refuse(req, raw, ErrorCode.NOT_FOUND, f"LoRA adapter {req.lora!r} is not loaded for "
                                                               f"{self.cfg.deployment}")
            return False
        try:
            await asyncio.get_running_loop().run_in_executor(None, lora.prefetch, req.lora)
        except LoRAAdapterError as exc:
            await self._refuse(req, raw, ErrorCode.BAD_REQUEST, str(exc))
            return False
        return True

    # ---- LoRA adapters: the deployment's registry, applied here ------------------------------
    async def on_adapters(self, _msg: LoraAdaptersChanged, _raw) -> None:
        await self.sync_adapters()

    async def sync_adapters(self) -> None:
        """Register and unregister adapters to match the deployment's registry. An adapter that
        cannot serve here is logged and skipped; the others serve on."""
        lora = self.engine.adapters
        try:
            wanted = await adapters.read(self.redis, self.cfg.deployment)
        except Exception as exc:  # Redis away: keep what we serve
            log.warning("adapter registry unavailable", error=str(exc))
            return
        loop = asyncio.get_running_loop()
        for name in set(lora.names()) - set(wanted):
            lora.unregister(name)
            log.info("lora adapter unloaded", adapter=name)
        for name, entry in wanted.items():
            current = lora.path_of(name)
            if current is not None and current == Path(entry.path).expanduser().resolve():
                continue
            if current is not None:
                lora.unregister(name)
            try:
                info = await loop.run_in_executor(None, lora.register, name, entry.path)
            except LoRAAdapterError as exc:
                log.warning("lora adapter refused", adapter=name, path=entry.path, error=str(exc))
                continue
            log.info("lora adapter loaded", adapter=name, path=entry.path, rank=info.rank, modules=info.modules)

    async def _adapter_sync_loop(self, interval: float = 5.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.sync_adapters()

    async def _refuse(self, req: GenerateRequest, raw, code: str, message: str) -> None:
        """Refused requests: the sender learns it on the ack if it asked for one (and owns the
        caller's final message); otherwise the caller gets a final error chunk."""
        log.info("request refused", request_id=req.request_id, code=code, reason=message)
        error = ErrorInfo(code=code, message=message)
        if raw.reply:
            await self.bus.publish(raw.reply, GenerateAck(req.request_id, self.cfg.replica_id, False, error))
        else:
            await self.bus.publish(req.reply_to, TokenChunk(request_id=req.request_id, seq=0, finish_reason="error",
                                                            error=error, replica_id=self.cfg.replica_id))

    # ---- streams: one ChunkSink per accepted request, one outbox for all ---------------------
    def _stream_ended(self, sink: ChunkSink) -> None:
        """A stream sent its final message."""
        self._streams.pop(sink.req.request_id, None)
        if self.state == "ready":
            self._load_changed()

    # ---- cancel, KV events, heartbeats -------------------------------------------------------
    async def on_cancel(self, msg: Cancel, raw) -> None:
        if msg.replica_id is not None and msg.replica_id != self.cfg.replica_id:
            return  # it withdraws the request from another replica: this one may be its retry
        sink = self._streams.get(msg.request_id)
        if sink is None:
            # Not ours, or not here yet (the cancel overtook its generate message): remember it
            # for a while so a late generate is refused instead of running for nobody.
            self._early_cancels[msg.request_id] = (time.monotonic(), msg.tenant)
            return
        if sink.req.tenant is not None and msg.tenant != sink.req.tenant:
            log.warning("cancel refused: tenant mismatch", request_id=msg.request_id)
            return
        log.info("cancel", request_id=msg.request_id, withdrawn=msg.replica_id is not None)
        if msg.replica_id is not None:  # taken after its scheduler gave up on it: the caller is served elsewhere
            sink.withdraw()
        else:
            self.engine.abort(msg.request_id)

    async def _publish_kv_events(self) -> None:
        """In order, one batch per engine step that changed the cache; the first batch of this
        process says `cleared` (a restarted engine starts empty)."""
        subject = protocol.kv_events(self.cfg.deployment, self.cfg.replica_id)
        while True:
            seq, events = await self._kv_queue.get()
            batch = KvEventBatch(replica_id=self.cfg.replica_id, model=self.cfg.deployment, seq=seq,
                                 stored=[KvBlockStored(block_hash=h, parent_hash=p) for h, p in events.stored],
                                 removed=list(events.removed), cleared=seq == 1, epoch=self.epoch)
            try:
                await self.bus.publish(subject, batch)
            except Exception as exc:  # a lost batch shows as a gap; the indexer resyncs
                log.warning("kv event publish failed", error=str(exc))

    async def on_kv_snapshot(self, _req: KvSnapshotRequest, raw) -> None:
        seq, hashes = await self.engine.kv_snapshot()
        if raw.reply:
            await self.bus.publish(raw.reply, KvSnapshot(replica_id=self.cfg.replica_id, seq=seq,
                                                         block_hashes=sorted(hashes), epoch=self.epoch))

    def heartbeat(self, stats: dict | None = None) -> Heartbeat:
        """The replica's heartbeat now. Called on the heartbeat thread too: it reads counters as
        they are and waits on nothing."""
        if self.engine is None or self.engine.limits is None:  # the model is loading
            return Heartbeat(replica_id=self.cfg.replica_id, model=self.cfg.deployment,
                             deployment=self.cfg.deployment, state=self.state, timestamp=time.time(),
                             revision=self.cfg.revision)
        stats = stats or self.engine.stats()
        queries = stats["prefix_cache_queries"]
        return Heartbeat(
            replica_id=self.cfg.replica_id, model=self.cfg.deployment, deployment=self.cfg.deployment,
            # Requests handed to the engine thread but not yet in its scheduler count as waiting:
            # a report that missed them would draw more work to a replica that already has it.
            state=self.state, running=stats["running"],
            waiting=max(self.engine.num_open_streams - stats["running"], stats["waiting"]),
            kv_blocks_used=stats["used_blocks"], kv_blocks_total=stats["total_blocks"],
            quantization=stats["quantization"], kv_cache_dtype=stats["kv_cache_dtype"],
            prefix_hit_rate=stats["prefix_cache_hits"] / queries if queries else 0.0,
            tokens_per_s=self._tokens_per_s, block_size=self.engine.limits.block_size,
            max_num_seqs=self.engine.limits.max_num_seqs, accepted_total=self._accepted_total,
            timestamp=time.time(), revision=self.cfg.revision, ttft_p90_s=self._latency[0],
            itl_p50_s=self._latency[1], requests_finished=self.metrics.finished_total,
            requests_failed=self.metrics.failed_total, steps_total=stats["num_steps"], region=self.cfg.region,
            pool=self.cfg.pool, lora_resident=stats.get("lora_resident", []),
            lora_cached=stats.get("lora_cached", []), lora_running=stats.get("lora_running", []),
            lora_waiting=stats.get("lora_waiting", []), max_loras=stats.get("max_loras", 0),
            max_lora_rank=stats.get("max_lora_rank", 0), max_model_len=stats["max_model_len"],
            vocab_size=stats["vocab_size"])

    def _registry_fields(self) -> dict:
        return {"http_url": self.http_url, "host": socket.gethostname(), "pid": os.getpid()}

    def _update_rate(self) -> None:
        now, tokens = time.monotonic(), self.engine.tokens_generated
        then, tokens_then = self._last_tokens
        self._tokens_per_s = (tokens - tokens_then) / max(now - then, 1e-6)
        self._last_tokens = (now, tokens)

    def _load_changed(self) -> None:
        """A request finished: tell the schedulers now (at most every 50 ms), not at the next
        heartbeat, so queued work is dispatched as soon as there is room."""
        now = time.monotonic()
        if now - self._last_heartbeat >= 0.05:
            self._last_heartbeat = now
            self._spawn(self.bus.publish(protocol.heartbeat(self.cfg.replica_id), self.heartbeat()))

    def _refresh_figures(self) -> None:
        """What the heartbeat thread reports but only this loop can compute: the token rate, the
        recent latencies (their windows are written on this loop), the engine gauges."""
        self._update_rate()
        self._latency = (self.metrics.recent_ttft.quantile(0.9), self.metrics.recent_itl.quantile(0.5))
        self.metrics.update_engine(self.engine.stats())

    async def _heartbeat_once(self) -> None:
        """A heartbeat now, on this loop's connections (a change of state must not wait for the
        heartbeat thread's next beat)."""
        self._refresh_figures()
        hb = self.heartbeat()
        self._last_heartbeat = time.monotonic()
        await self.bus.publish(protocol.heartbeat(self.cfg.replica_id), hb)
        await registry.refresh(self.redis, self.cfg.replica_id, self.cfg.deployment,
                               hb.to_dict() | self._registry_fields(), self.cfg.lease_ttl)

    async def _heartbeat_loop(self) -> None:
        """The periodic beats come from the heartbeat thread; this keeps their figures fresh and
        notices a dead engine loop at once (a core process that dies is known the moment its
        socket closes)."""
        while True:
            if self.engine.failed.is_set():  # told already: beat on
                await asyncio.sleep(self.cfg.heartbeat_interval)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.engine.failed.wait(), self.cfg.heartbeat_interval)
            cutoff = time.monotonic() - 30.0
            for rid, (at, _) in list(self._early_cancels.items()):
                if at < cutoff:
                    del self._early_cancels[rid]
            if self.engine.error is not None and self.state != "failed":
                # The engine loop is dead: stop advertising, leave, exit non-zero to be restarted.
                log.error("engine failed; leaving the fleet", error=str(self.engine.error))
                self.state = "failed"
                self.exit_code = 1
                self._stopping.set()
            self._refresh_figures()

    # ---- http -------------------------------------------------------------------------------
    async def _http_metrics(self, request: web.Request) -> web.Response:
        self.metrics.update_engine(self.engine.stats())
        return metrics_response(request, self.metrics.registry, self.history)

    async def _http_health(self, _request: web.Request) -> web.Response:
        body = {"state": self.state, "replica_id": self.cfg.replica_id, "deployment": self.cfg.deployment}
        return web.json_response(body, status=200 if self.state == "ready" else 503)
