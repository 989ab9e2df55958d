"""The engine for asyncio services: the step loop runs in its own thread, never on the event loop.

Requests are validated on the caller's thread (so a bad one raises at add time) and handed to
the loop thread through a command queue; each step's outputs come back to the event loop and
are delivered to one stream per request. services.engine.core_client is the same interface with
the step loop in a process of its own.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from services.engine.block_manager import KvEvents
from services.engine.config import EngineArgs
from services.engine.engine_client import (EngineClient, EngineDeadError, EngineLimits, RequestSink,  # noqa: F401
                                           RequestStream, StepFailedError, StepGuard, fail, resolve)
from services.engine.llm_engine import LLMEngine
from services.engine.model_runner import StepTimings
from services.engine.sampling_params import SamplingParams
from shared.logging import get_logger

log = get_logger()


class AsyncLLMEngine(EngineClient):
    """`engine_factory` builds the LLMEngine inside the loop thread: torch runs 15-25% slower on
    CPU when a model built on one thread is stepped from another (OpenMP thread teams)."""

    def __init__(self, engine_factory: Callable[[], LLMEngine],
                 on_kv_events: Callable[[int, KvEvents], None] | None = None,
                 on_step: Callable[[StepTimings], None] | None = None):
        super().__init__(on_kv_events, on_step)  # on_step: called on the engine thread here
        self._factory = engine_factory
        self.engine: LLMEngine | None = None
        self.kv_seq = 0  # engine thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

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
        self.inputs, self.structured = self.engine.inputs, self.engine.structured
        self.limits = EngineLimits.of(self.engine)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---- the worker's interface to the engine -----------------------------------------------
    def stats(self) -> dict:
        return self.engine.stats()

    def compile_grammar(self, spec) -> None:
        """Compile a structured-output spec into the cache (blocking: run it off the event loop)."""
        self.engine.structured.compile(spec)

    @property
    def adapters(self):
        """The LoRA adapters served (LoRAManager's registry interface), or None without enable_lora."""
        return self.engine.lora

    # ---- requests ---------------------------------------------------------------------------
    def _submit(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                arrival_time: float | None, resumed: tuple[int, int], lora_name: str | None) -> None:
        if lora_name is not None:
            self.engine.acquire_lora(lora_name)  # pinned here, on the caller's thread
        self._commands.put(("add", request_id, text, ids, params, arrival_time or time.monotonic(), resumed,
                            lora_name))
        self._wake.set()

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
            self._loop.call_soon_threadsafe(fail, built, exc)
            return
        self._loop.call_soon_threadsafe(resolve, built, None)
        guard = StepGuard(engine)
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs, failed, exc = guard.step()
                if exc is not None:
                    self._loop.call_soon_threadsafe(
                        self._fail_requests, failed, StepFailedError(f"engine step failed: {exc.__class__.__name__}"))
                    continue
                if self.on_step is not None and engine.last_step is not None:
                    self.on_step(engine.last_step)
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
                self._loop.call_soon_threadsafe(resolve, command[1], (self.kv_seq, hashes))

    def _number(self, events: KvEvents) -> tuple[int, KvEvents]:
        if events:
            self.kv_seq += 1
        return self.kv_seq, events
