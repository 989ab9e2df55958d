"""What the engine worker needs of an engine, whichever process its step loop runs in.

Two clients share this: AsyncLLMEngine (services.engine.async_engine: the step loop in a thread
of this process) and CoreClient (services.engine.core_client: the step loop in a core process of
its own, services.engine.core_process). Both validate and tokenize a request on the caller's
thread (so a bad one raises at add time), keep one sink per open request on the event loop, and
offer the same small interface to the worker: `limits`, `stats()`, `encode(text)`,
`compile_grammar(spec)`, `adapters`, `error` / `failed`.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.engine.block_manager import KvEvents
from services.engine.choices import check_resumable
from services.engine.model_runner import StepTimings
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from shared.logging import get_logger

log = get_logger()

MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; every open stream gets it."""


class StepFailedError(RuntimeError):
    """A step failed; the requests it held were aborted (the engine serves on)."""


def resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


@dataclass(frozen=True)
class EngineLimits:
    """The engine's effective limits, known once it is built (max_model_len may be below the
    model's: the KV cache or a sliding window can bound it)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    max_num_seqs: int
    num_kv_blocks: int

    @classmethod
    def of(cls, engine) -> "EngineLimits":
        return cls(engine.max_model_len, engine.model_config.vocab_size, engine.args.block_size,
                   engine.args.max_num_seqs, engine.block_manager.num_blocks)


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


class StepGuard:
    """One bad step must not take the replica down: a failing step aborts the requests it held
    (freeing their blocks) and the loop serves on; MAX_CONSECUTIVE_STEP_FAILURES in a row stop it."""

    def __init__(self, engine):
        self.engine = engine
        self.failures = 0

    def step(self) -> tuple[list[RequestOutput], list[str], BaseException | None]:
        """(outputs, request ids failed by this step, its error); raises once the loop must stop."""
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as exc:
            self.failures += 1
            if self.failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            log.exception("engine step failed: aborting the requests it held")
            failed = list(engine.requests)
            for rid in failed:
                engine.abort_request(rid)  # frees their blocks
            engine.discard_pending_outputs()
            return [], failed, exc
        self.failures = 0
        return outputs, [], None


class EngineClient(abc.ABC):
    """The part both clients share: the open requests' sinks, delivery on the event loop, and
    failing them when a step or the whole loop fails. Subclasses set `inputs` and `structured`
    (the worker-side InputProcessor and StructuredOutputs) once the engine is built, and
    implement `_submit`, `abort`, `kv_snapshot`, `start`, `shutdown`."""

    def __init__(self, on_kv_events: Callable[[int, KvEvents], None] | None = None,
                 on_step: Callable[[StepTimings], None] | None = None):
        # Called on the event loop with each step's KV events and their batch seq, numbered where
        # the step ran so that a snapshot can say exactly which batches it includes.
        self.on_kv_events = on_kv_events
        self.on_step = on_step  # each step's phase timings
        self._streams: dict[str, RequestSink] = {}
        self.error: BaseException | None = None
        self.failed = asyncio.Event()  # set (on the event loop) once the engine is dead
        self.tokens_generated = 0
        self.inputs = None  # InputProcessor, once built
        self.structured = None  # StructuredOutputs, once built
        self.limits: EngineLimits | None = None  # None while the engine is being built

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids, as the engine will see them (thread-safe)."""
        return self.inputs.tokenizer.encode(text)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, sink: RequestSink | None = None,
                    resumed: tuple[int, int] = (0, 0), lora_name: str | None = None) -> RequestSink:
        """Queue a request; its outputs go to `sink`, by default a new RequestStream (an async
        iterator). A service streaming many requests passes its own sink and saves waking one
        task per request per step. `resumed`, `lora_name`: see LLMEngine.add_processed (the
        adapter is checked here, on the caller's thread)."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids, params = self.inputs.process(prompt, params)
        check_resumable(params, resumed[0])  # here: the step loop must not meet a refusal
        if params.structured is not None and resumed[0]:  # its replay must not fail on the step loop
            self.structured.matcher(params.structured, ids[len(ids) - resumed[0]:])
        stream = sink if sink is not None else RequestStream(request_id)
        self._submit(request_id, text, ids, params, arrival_time, resumed, lora_name)
        self._streams[request_id] = stream
        return stream

    @abc.abstractmethod
    def _submit(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                arrival_time: float | None, resumed: tuple[int, int], lora_name: str | None) -> None:
        """Hand a validated request to the step loop: a thread's command queue, or the core
        process's socket."""

    # ---- delivery, on the event loop --------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], seq: int, events: KvEvents | None) -> None:
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
                stream.fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """The engine is dead: every open stream gets EngineDeadError, once."""
        if self.error is None:
            self.error = exc
        self.failed.set()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(EngineDeadError(f"engine stopped: {exc}"))
