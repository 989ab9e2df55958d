"""Shared test helpers: start engine worker processes, stream a request over NATS."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from shared import keys, protocol
from shared.localstack import engine_module_args
from shared.protocol import GenerateRequest, TokenChunk


@dataclass
class WorkerProcess:
    replica_id: str
    proc: subprocess.Popen
    log_path: str

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def start_worker(infra, model_dir, tmp_path, replica_id: str | None = None, *extra: str,
                 deployment: str = "tiny") -> WorkerProcess:
    replica_id = replica_id or f"w-{uuid.uuid4().hex[:6]}"
    log_path = str(tmp_path / f"{replica_id}.log")
    cmd = [sys.executable, "-m", *engine_module_args(model_dir, replica_id, deployment, infra, *extra)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    return WorkerProcess(replica_id, proc, log_path)


async def wait_registered(redis, worker: WorkerProcess, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {worker.proc.returncode}:\n{worker.log()}")
        entry = await redis.hgetall(keys.replica(worker.replica_id))
        if entry and entry.get(b"state") == b"ready":
            return {k.decode(): v.decode() for k, v in entry.items()}
        await asyncio.sleep(0.1)
    raise TimeoutError(f"worker {worker.replica_id} not registered:\n{worker.log()}")


async def stream_request(bus, subject: str, request: GenerateRequest, timeout: float = 60,
                         on_chunk=None) -> list[TokenChunk]:
    """Publish a generate request and collect its chunks until the final one."""
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def handler(msg):
        chunk = protocol.decode(TokenChunk, msg.data)
        chunks.append(chunk)
        if on_chunk is not None:
            await on_chunk(chunk)
        if chunk.is_final:
            done.set()

    sub = await bus.nc.subscribe(request.reply_to, cb=handler)
    try:
        await bus.publish(subject, request)
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return chunks


def new_request(prompt, max_tokens=16, **sampling) -> GenerateRequest:
    rid = uuid.uuid4().hex
    spec = protocol.SamplingParams(max_tokens=max_tokens, **sampling)
    kwargs = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    return GenerateRequest(request_id=rid, model="tiny", reply_to=f"_INBOX.test.{rid}", sampling=spec, **kwargs)
