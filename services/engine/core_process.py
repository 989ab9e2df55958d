"""The engine core in a process of its own (engine argument engine_core=process), as vLLM v1:
it owns the LLMEngine and runs the step loop (schedule, forward, sample), handing out token ids;
the worker process (services.engine.core_client.CoreClient) keeps NATS, tokenization, input
validation, detokenization and stop strings (services.engine.output_processor), and builds each
RequestOutput from what the core sends. A choice a stop string ended there is stopped here by a
"stop" command, so it may run one step more than it needed (its extra tokens are dropped there).

Transport: one Unix socketpair, length-prefixed pickled messages (multiprocessing.connection
framing). Chosen over ZMQ for one message per step: a message is one write and one read syscall,
with no I/O thread between the two processes (ZMQ hands every message to its I/O thread on both
sides) and nothing to install; the worker's event loop reads the socket directly (add_reader),
and a core that dies closes it, so the worker knows at once. Both ends are this code, so pickle
is safe here (nothing else can reach an unnamed socketpair).

Core -> worker, one message per step:
  ("step", outputs, kv_seq, kv_events | None, StepTimings | None, stats)
     outputs: one StepOutput tuple per request output (new token ids, logprobs, finish reason;
     the completion, metrics and usage when a choice ends; the metrics every step for a request
     with stop strings, which the worker may end first)
  ("failed", request_ids, message)   a step failed; those requests were aborted
  ("rejected", request_id, error)    add refused on the core (an adapter that cannot be read)
  ("snapshot", call_id, kv_seq, kv_events, block_hashes)
  ("reply", call_id, ok, value | error)
  ("ready", EngineLimits, stats, lora_enabled) / ("error", exception) at start; ("dead", message)
Worker -> core: ("init", model_dir, EngineArgs, log_format, log_level, log_context) first, then
  ("add", rid, text, ids, params, arrival, resumed, lora_name), ("abort", rid), ("stop", rid, index),
  ("snapshot", call_id), ("compile", spec), ("call", call_id, method, args), ("shutdown",).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import structlog

from services.engine.engine_client import EngineLimits, StepGuard
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import InvalidRequestError
from shared.logging import configure_logging, get_logger

log = get_logger()

IDLE_POLL_S = 0.5  # an idle core wakes this often (a command or the worker's end wakes it at once)
# The adapter calls the worker may make, run off the step loop in order of arrival.
CALLS = {"lora_register": "register", "lora_unregister": "unregister", "lora_prefetch": "prefetch"}


def dumps(message) -> bytes:
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def portable(exc: BaseException) -> BaseException:
    """exc if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{exc.__class__.__name__}: {exc}")


class EngineCore:
    def __init__(self, conn: Connection, engine):
        self.conn, self.engine = conn, engine
        self._send_lock = threading.Lock()  # the step loop and the call threads both send
        self.kv_seq = 0
        self._calls = ThreadPoolExecutor(1, "core-calls")  # adapter registry reads, in order
        self._compiles = ThreadPoolExecutor(1, "core-compile")  # grammars, before their request arrives
        self._prompt_logprobs_sent: set[str] = set()
        self._stop_strings: set[str] = set()  # open requests with stop strings

    def send(self, message) -> None:
        data = dumps(message)
        with self._send_lock:
            self.conn.send_bytes(data)

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """Step until the worker says shutdown or goes away (its end of the socket closes)."""
        engine, guard = self.engine, StepGuard(self.engine)
        while True:
            while self.conn.poll(0 if engine.has_unfinished_requests() else IDLE_POLL_S):
                if not self.apply(pickle.loads(self.conn.recv_bytes())):
                    return
            if not engine.has_unfinished_requests():
                continue
            outputs, failed, exc = guard.step()
            if exc is not None:
                for rid in failed:
                    self._forget(rid)
                self.send(("failed", failed, f"engine step failed: {exc.__class__.__name__}"))
                continue
            self.send_step([self.step_output(out) for out in outputs], engine.last_step)

    def send_step(self, outputs: list[tuple], timings) -> None:
        seq, events = self.number(self.engine.drain_kv_events())
        self.send(("step", outputs, seq, events or None, timings, self.engine.stats()))

    def number(self, events):
        if events:
            self.kv_seq += 1
        return self.kv_seq, events

    def step_output(self, out: RequestOutput) -> tuple:
        """What the worker needs to rebuild `out`: it knows the prompt; the completion's text,
        ids and logprobs, the metrics and usage cross once, when the choice ends."""
        completion = out.outputs[0]
        prompt_logprobs = None
        if out.prompt_logprobs is not None and out.request_id not in self._prompt_logprobs_sent:
            self._prompt_logprobs_sent.add(out.request_id)
            prompt_logprobs = out.prompt_logprobs
        metrics = out.metrics if out.request_id in self._stop_strings else None
        if out.finished:
            self._forget(out.request_id)
        ended = None
        if completion.finish_reason is not None:
            ended = (completion.token_ids, completion.logprobs, out.num_cached_tokens, out.num_completion_tokens,
                     out.metrics)
        return (out.request_id, completion.index, out.new_token_ids, out.new_logprobs, completion.finish_reason,
                out.choices_running, out.finished, prompt_logprobs, ended, metrics)

    def _forget(self, request_id: str) -> None:
        self._prompt_logprobs_sent.discard(request_id)
        self._stop_strings.discard(request_id)

    # ---- commands ---------------------------------------------------------------------------
    def apply(self, command: tuple) -> bool:
        """Apply one command; False for shutdown."""
        kind, engine = command[0], self.engine
        if kind == "add":
            _, rid, text, ids, params, arrival, resumed, lora_name = command
            try:
                if lora_name is not None:
                    engine.acquire_lora(lora_name)
                engine.add_processed(rid, text, ids, params, arrival, resumed, lora_name)
                if params.stop:
                    self._stop_strings.add(rid)
            except InvalidRequestError as exc:  # checked by the worker already: a race with an unload
                self.send(("rejected", rid, exc))
        elif kind == "abort":
            engine.abort_request(command[1])
        elif kind == "stop":
            engine.stop_choice(command[1], command[2])
            if command[1] not in engine.requests:  # its last choice: no output will say it finished
                self._forget(command[1])
            if not engine.has_unfinished_requests():  # no step will follow: the figures say it is idle now
                self.send_step([], None)
        elif kind == "snapshot":
            seq, events = self.number(engine.drain_kv_events())
            self.send(("snapshot", command[1], seq, events or None, engine.block_manager.cached_block_hashes()))
        elif kind == "compile":
            self._compiles.submit(self._compile, command[1])
        elif kind == "call":
            self._calls.submit(self._call, *command[1:])
        elif kind == "shutdown":
            return False
        else:
            raise ValueError(f"unknown engine core command {kind!r}")
        return True

    def _compile(self, spec) -> None:
        try:
            self.engine.structured.compile(spec)
        except InvalidRequestError:  # the worker compiled it too and refused the request
            pass

    def _call(self, call_id: int, method: str, args: tuple) -> None:
        try:
            value = getattr(self.engine.lora, CALLS[method])(*args)
        except Exception as exc:
            self.send(("reply", call_id, False, portable(exc)))
        else:
            self.send(("reply", call_id, True, value))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.engine.core_process",
                                description="Strata engine core (started by the engine worker)")
    p.add_argument("--fd", type=int, required=True, help="this end of the worker's socketpair")
    conn = Connection(p.parse_args(argv).fd)
    _, model_dir, args, log_format, log_level, log_context = pickle.loads(conn.recv_bytes())
    configure_logging("engine-core", log_format, log_level)
    structlog.contextvars.bind_contextvars(**log_context)
    from services.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(model_dir, args, detokenize=False)
    except BaseException as exc:
        log.exception("engine core failed to start")
        conn.send_bytes(dumps(("error", portable(exc))))
        return 1
    core = EngineCore(conn, engine)
    core.send(("ready", EngineLimits.of(engine), engine.stats(), engine.lora is not None))
    try:
        core.run()
    except (EOFError, OSError):  # the worker is gone: nobody is left to serve
        log.warning("engine worker went away; core exiting")
        return 1
    except BaseException as exc:
        log.exception("engine core loop failed")
        try:
            core.send(("dead", f"{exc.__class__.__name__}: {exc}"))
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
