"""The engine for asyncio services: the step loop runs in its own thread, never on the event loop.

Requests are validated on the caller's thread (so a bad one raises at add time) and handed to
the loop thread through a command queue; each step's outputs come back to the event loop and
are delivered to one stream per request.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from services.engine.block_manager import KvEvents
from services.engine.choices import check_resumable
from services.engine.config import EngineArgs
from services.engine.llm_engine import LLMEngine
from services.engine.model_runner import StepTimings
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.logging import get_logger

log = get_logger()


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; every open stream gets it."""


class StepFailedError(RuntimeError):
    """A step failed; the requests it held were aborted (the engine serves on)."""


MAX_CONSECUTIVE_STEP_FAILURES = 3


class RequestSink(Protocol):
    """Where one request's step outputs go, on the event loop thread."""

    def deliver(self, out: RequestOutput) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


class RequestStream:
    """Async iterator over one request's step outputs; ends after the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def deliver(self, out: RequestOutput) -> None:
        self.queue.put_nowait(out)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)


class AsyncLLMEngine:
    """`engine_factory` builds the LLMEngine inside the loop thread: torch runs 15-25% slower on
    CPU when a model built on one thread is stepped from another (OpenMP thread teams)."""

    def __init__(self, engine_factory: Callable[[], LLMEngine],
                 on_kv_events: Callable[[int, KvEvents], None] | None = None,
                 on_step: Callable[[StepTimings], None] | None = None):
        self._factory = engine_factory
        self.engine: LLMEngine | None = None
        # Called on the event loop with each step's KV events and their batch seq, numbered on
        # the engine thread so that a snapshot can say exactly which batches it includes.
        self.on_kv_events = on_kv_events
        self.on_step = on_step  # called on the engine thread with each step's phase timings
        self.kv_seq = 0  # engine thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestSink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.tokens_generated = 0

    @classmethod
    def from_model(cls, model_dir: str | Path, **engine_args) -> "AsyncLLMEngine":
        args = EngineArgs.from_kwargs(**engine_args)
        return cls(lambda: LLMEngine(model_dir, args))

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loop thread; returns once it has built the engine (or raises its error)."""
        self._loop = asyncio.get_running_loop()
        # Two busy threads share the GIL here (the step loop and the event loop streaming its
        # tokens); Python's default 5 ms switch interval would make each wait up to 5 ms.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        built = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="engine-loop", daemon=True)
        self._thread.start()
        await built

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, sink: RequestSink | None = None,
                    resumed: tuple[int, int] = (0, 0), lora_name: str | None = None) -> RequestSink:
        """Queue a request; its outputs go to `sink`, by default a new RequestStream (an async
        iterator). A service streaming many requests passes its own sink and saves waking one
        task per request per step. `resumed`, `lora_name`: see LLMEngine.add_processed (the
        adapter is pinned here, on the caller's thread)."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids, params = self.engine.inputs.process(prompt, params)
        check_resumable(params, resumed[0])  # here: the loop thread must not meet a refusal
        if lora_name is not None:
            self.engine.acquire_lora(lora_name)
        stream = sink if sink is not None else RequestStream(request_id)
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, text, ids, params, arrival_time or time.monotonic(), resumed,
                            lora_name))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason 'abort' and its blocks are freed
        before the next step."""
        if request_id in self._streams:
            self._commands.put(("abort", request_id))
            self._wake.set()

    async def kv_snapshot(self) -> tuple[int, set[int]]:
        """(seq, block hashes cached right now): the snapshot includes every KV event batch up
        to seq, and those batches reach on_kv_events before this returns."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("snapshot", future))
        self._wake.set()
        return await asyncio.wait_for(future, 30)

    # ---- the loop thread --------------------------------------------------------------------
    def _run(self, built: asyncio.Future) -> None:
        try:
            self.engine = engine = self._factory()
        except BaseException as exc:
            self._loop.call_soon_threadsafe(_fail, built, exc)
            return
        self._loop.call_soon_threadsafe(_resolve, built, None)
        failures = 0
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    outputs = engine.step()
                    failures = 0
                    if self.on_step is not None and engine.last_step is not None:
                        self.on_step(engine.last_step)
                except Exception as exc:  # one bad step must not take the replica down
                    failures += 1
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    log.exception("engine step failed: aborting the requests it held")
                    failed = list(engine.requests)
                    for rid in failed:
                        engine.abort_request(rid)  # frees their blocks
                    engine.discard_pending_outputs()
                    self._loop.call_soon_threadsafe(self._fail_requests, failed, exc)
                    continue
                self._loop.call_soon_threadsafe(self._deliver, outputs, *self._number(engine.drain_kv_events()))
        except BaseException as exc:  # the loop is dead: tell every stream, once
            log.exception("engine loop failed")
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, text, ids, params, arrival, resumed, lora_name = command
                self.engine.add_processed(rid, text, ids, params, arrival, resumed, lora_name)
            elif command[0] == "abort":
                self.engine.abort_request(command[1])
            else:  # snapshot
                seq, events = self._number(self.engine.drain_kv_events())
                hashes = self.engine.block_manager.cached_block_hashes()
                self._loop.call_soon_threadsafe(self._deliver, [], seq, events)
                self._loop.call_soon_threadsafe(_resolve, command[1], (self.kv_seq, hashes))

    def _number(self, events: KvEvents) -> tuple[int, KvEvents]:
        if events:
            self.kv_seq += 1
        return self.kv_seq, events

    def _deliver(self, outputs: list[RequestOutput], seq: int, events: KvEvents) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self.tokens_generated += len(out.new_token_ids)
            if out.finished:
                del self._streams[out.request_id]
            stream.deliver(out)
        if self.on_kv_events is not None and events:
            self.on_kv_events(seq, events)

    def _fail_requests(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.fail(StepFailedError(f"engine step failed: {exc.__class__.__name__}"))

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(EngineDeadError(f"engine stopped: {exc}"))
