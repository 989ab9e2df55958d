"""The worker's side of an engine core in its own process (services.engine.core_process): the
AsyncLLMEngine interface, with the step loop in another process.

The worker tokenizes and validates each request itself (its own tokenizer, InputProcessor and
StructuredOutputs, built while the core loads the model), sends it to the core, and rebuilds a
RequestOutput per request from each step's one message, its text made here by an
OutputProcessor (which also ends choices on stop strings, and tells the core to stop them). A reader thread takes the core's
messages off its socket (so the figures heartbeats report stay current, and the core never waits
on a busy event loop) and hands them to the event loop, all that arrived at once in one wake-up;
when the core dies the socket closes, and every open stream fails with EngineDeadError at once
(the worker then reports the replica failed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import structlog

from services.engine.block_manager import KvEvents
from services.engine.config import EngineArgs
from services.engine.core_process import dumps
from services.engine.engine_client import (EngineClient, EngineDeadError, StepFailedError, fail, resolve)
from services.engine.input_processor import InputProcessor
from services.engine.model_config import ModelConfig
from services.engine.model_runner import StepTimings
from services.engine.output_processor import OutputProcessor
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.engine.structured import StructuredOutputs
from shared.logging import get_logger

log = get_logger()

START_TIMEOUT_S = 900.0  # building the engine: reading a large checkpoint, sizing the KV cache
CALL_TIMEOUT_S = 60.0  # an adapter call (reads an adapter's files on the core)
STOP_TIMEOUT_S = 10.0


class CoreAdapters:
    """The LoRA adapters the core serves, for the worker: names and paths from a mirror kept
    here (read on the event loop without a round trip), changes and host-cache reads forwarded
    to the core. register/prefetch block on the core's answer: call them off the event loop."""

    def __init__(self, client: "CoreClient"):
        self._client = client
        self._paths: dict[str, Path] = {}

    def names(self) -> list[str]:
        return sorted(self._paths)

    def path_of(self, name: str) -> Path | None:
        return self._paths.get(name)

    def register(self, name: str, path: str | Path):
        info = self._client.call("lora_register", name, path)
        self._paths[name] = Path(path).expanduser().resolve()
        return info

    def unregister(self, name: str) -> bool:
        """New requests for it are refused here at once; the core retires it after its running ones."""
        if self._paths.pop(name, None) is None:
            return False
        self._client.call_soon("lora_unregister", name)
        return True

    def prefetch(self, name: str) -> None:
        self._client.call("lora_prefetch", name)


class CoreClient(EngineClient):
    def __init__(self, model_dir: str | Path, args: EngineArgs,
                 on_kv_events: Callable[[int, KvEvents], None] | None = None,
                 on_step: Callable[[StepTimings], None] | None = None,
                 log_format: str = "auto", log_level: str = "info"):
        super().__init__(on_kv_events, on_step)  # both called on the event loop here
        self.model_dir, self.args = str(model_dir), args
        self._log = (log_format, log_level)
        self.process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._built: asyncio.Future | None = None
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._stats: dict = {}
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # open requests' prompt text and ids
        self._closing = False
        self._reader: threading.Thread | None = None
        self.adapters: CoreAdapters | None = None
        self.outputs: OutputProcessor | None = None  # text and stop strings, once started

    @classmethod
    def from_model(cls, model_dir: str | Path, **engine_args) -> "CoreClient":
        return cls(model_dir, EngineArgs.from_kwargs(**engine_args))

    @property
    def core_pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the core process; returns once it has built the engine (or raises its error)."""
        self._loop = loop = asyncio.get_running_loop()
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))  # the reader thread hands on at once
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "services.engine.core_process", "--fd",
                                         str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        self._conn = Connection(ours.detach())
        self._built = loop.create_future()
        self._send(("init", self.model_dir, self.args, *self._log, structlog.contextvars.get_contextvars()))
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()
        worker_side = loop.run_in_executor(None, self._load_inputs)  # while the core loads the model
        try:
            self.limits, self._stats, lora_enabled = await asyncio.wait_for(self._built, START_TIMEOUT_S)
            config, tokenizer, self.structured = await worker_side
        except BaseException:
            await self._stop_process(0)
            raise
        self.inputs = InputProcessor(tokenizer, config, self.limits.max_model_len,
                                     config.generation_defaults(self.args.generation_config), self.structured)
        self.adapters = CoreAdapters(self) if lora_enabled else None
        self.outputs = OutputProcessor(tokenizer.backend_tokenizer)
        log.info("engine core started", core_pid=self.process.pid)

    def _load_inputs(self):
        from services.engine.llm_engine import load_tokenizer

        config = ModelConfig.load(self.model_dir)
        tokenizer = load_tokenizer(self.model_dir)
        return config, tokenizer, StructuredOutputs(tokenizer, config.vocab_size, config.eos_token_ids)

    async def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._closing = True
        try:
            self._send(("shutdown",))
        except (OSError, EngineDeadError):
            pass
        await self._stop_process(timeout)

    async def _stop_process(self, timeout: float) -> None:
        self._closing = True
        if self.process is not None and self.process.poll() is None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.process.wait, timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine core did not stop; killing it", core_pid=self.process.pid)
                self.process.kill()
                await asyncio.get_running_loop().run_in_executor(None, self.process.wait, STOP_TIMEOUT_S)
        if self._reader is not None:  # it ends at the socket's end (the core exited) or its close
            await asyncio.get_running_loop().run_in_executor(None, self._reader.join, STOP_TIMEOUT_S)
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        if self._streams:
            self._fail_all(EngineDeadError("the engine was shut down"))

    # ---- the worker's interface to the engine -----------------------------------------------
    def stats(self) -> dict:
        """The core's figures as of its last step (sent with every step's message)."""
        return self._stats

    def compile_grammar(self, spec) -> None:
        """Compile a structured-output spec (blocking: run it off the event loop): here, which
        validates it, and on the core, off its step loop, so that the request finds it cached."""
        self.structured.compile(spec)
        self._send(("compile", spec))

    # ---- requests ---------------------------------------------------------------------------
    def _submit(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                arrival_time: float | None, resumed: tuple[int, int], lora_name: str | None) -> None:
        if lora_name is not None:
            if self.adapters is None:
                raise InvalidRequestError(f"LoRA adapter {lora_name!r} requested, but this engine serves no "
                                          f"adapters (engine argument enable_lora)", "model")
            if self.adapters.path_of(lora_name) is None:
                raise InvalidRequestError(f"LoRA adapter {lora_name!r} is not loaded", "model")
        self._send(("add", request_id, text, ids, params, arrival_time or time.monotonic(), resumed, lora_name))
        prompt_ids = ids[:len(ids) - resumed[0]]
        self._prompts[request_id] = (text, prompt_ids)
        self.outputs.add(request_id, prompt_ids, params, ids[len(prompt_ids):], resumed[1])

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason 'abort' and its blocks are freed
        before the core's next step."""
        if request_id in self._streams:
            try:
                self._send(("abort", request_id))
            except EngineDeadError:
                pass  # its stream fails with the engine

    async def kv_snapshot(self) -> tuple[int, set[int]]:
        """(seq, block hashes cached right now): the snapshot includes every KV event batch up
        to seq, and those batches reach on_kv_events before this returns."""
        call_id, future = self._new_call()
        self._send(("snapshot", call_id))
        return await asyncio.wait_for(asyncio.wrap_future(future), 30)

    def call(self, method: str, *args):
        """An adapter call on the core, waiting for its answer (blocking: not on the event loop)."""
        call_id, future = self._new_call()
        self._send(("call", call_id, method, args))
        return future.result(CALL_TIMEOUT_S)

    def call_soon(self, method: str, *args) -> None:
        """An adapter call on the core without waiting (its failure is logged there)."""
        call_id, future = self._new_call()
        future.add_done_callback(lambda f: f.exception() and log.warning("engine core call failed", method=method,
                                                                           error=str(f.exception())))
        self._send(("call", call_id, method, args))

    def _new_call(self) -> tuple[int, concurrent.futures.Future]:
        call_id, future = next(self._call_ids), concurrent.futures.Future()
        self._calls[call_id] = future
        return call_id, future

    def _send(self, message) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        data = dumps(message)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as exc:
            raise EngineDeadError(f"engine core unreachable: {exc}") from None

    # ---- the core's messages ----------------------------------------------------------------
    def _read(self) -> None:
        """The reader thread: every message that has arrived, to the event loop in one wake-up."""
        try:
            while True:
                messages = [pickle.loads(self._conn.recv_bytes())]
                while self._conn.poll(0):
                    messages.append(pickle.loads(self._conn.recv_bytes()))
                for message in messages:
                    if message[0] == "step":  # heartbeats read it on their own thread, loop or no loop
                        self._stats = message[5]
                self._loop.call_soon_threadsafe(self._handle_all, messages)
        except (EOFError, OSError):
            self._loop.call_soon_threadsafe(self._core_gone)

    def _handle_all(self, messages: list[tuple]) -> None:
        for message in messages:
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, seq, events, timings, _stats = message
            self._deliver(self._process(outputs), seq, events)
            if timings is not None and self.on_step is not None:
                # The step as the caller sees it: the core's, then its text here (phases still sum to wall).
                timings.detokenize = self.outputs.busy_s
                timings.wall += timings.detokenize
                self.on_step(timings)
        elif kind == "failed":
            _, request_ids, text = message
            for rid in request_ids:
                self._forget(rid)
            self._fail_requests(request_ids, StepFailedError(text))
        elif kind == "rejected":
            _, rid, exc = message
            self._forget(rid)
            self._fail_requests([rid], exc)
        elif kind == "snapshot":
            _, call_id, seq, events, hashes = message
            self._deliver([], seq, events)
            self._answer(call_id, True, (seq, hashes))
        elif kind == "reply":
            self._answer(*message[1:])
        elif kind == "ready":
            resolve(self._built, message[1:])
        elif kind == "error":
            fail(self._built, message[1])
        elif kind == "dead":
            self.error = EngineDeadError(f"engine core failed: {message[1]}")

    def _answer(self, call_id: int, ok: bool, value) -> None:
        future = self._calls.pop(call_id, None)
        if future is None:
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _process(self, step_outputs: list[tuple]) -> list[RequestOutput]:
        """A step's outputs with their text; the choices a stop string ended are stopped on the core."""
        processor, outputs = self.outputs, []
        processor.busy_s = 0.0
        for step_output in step_outputs:
            out = processor.process(self._output(step_output))
            if out is not None:
                outputs.append(out)
                if out.finished:
                    self._prompts.pop(out.request_id, None)
        for request_id, index in processor.take_stopped():
            try:
                self._send(("stop", request_id, index))
            except EngineDeadError:
                pass  # nothing runs any more
        return outputs

    def _output(self, step_output: tuple) -> RequestOutput:
        """The core's RequestOutput (token ids, no text) from its StepOutput tuple."""
        (rid, index, new_ids, new_logprobs, finish_reason, choices_running, finished, prompt_logprobs, ended,
         metrics) = step_output
        text, prompt_ids = self._prompts.get(rid, (None, []))
        if ended is None:  # a choice mid-stream: the deltas are what a stream reads
            completion, cached, completion_tokens = CompletionOutput(index, "", []), 0, 0
        else:
            token_ids, logprobs, cached, completion_tokens, metrics = ended
            completion = CompletionOutput(index, "", token_ids, finish_reason, logprobs)
        return RequestOutput(rid, text, prompt_ids, [completion], finished, cached, new_ids, "", new_logprobs,
                             metrics, choices_running, completion_tokens, prompt_logprobs)

    def _forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self.outputs.discard(request_id)

    def _core_gone(self) -> None:
        """The core's socket closed: it exited (or was killed). Everything open fails now."""
        code = self.process.poll()
        if code is None:
            try:
                code = self.process.wait(0.2)  # the socket closes as the process ends: reaped in a moment
            except subprocess.TimeoutExpired:
                pass
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        exc = self.error or EngineDeadError(f"engine core process {self.process.pid} ended ({how})")
        if not self._closing:
            log.error("engine core process ended", core_pid=self.process.pid, how=how)
        fail(self._built, exc)
        for future in list(self._calls.values()):
            future.set_exception(exc)
        self._calls.clear()
        self._prompts.clear()
        if self.outputs is not None:
            self.outputs.clear()
        self._fail_all(exc)
