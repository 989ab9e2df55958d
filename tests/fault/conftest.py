"""Fault injection on a real local stack: each test module gets its own NATS and Valkey (a test
that restarts them must not disturb any other), engines on the tiny model with one torch thread,
and real processes killed with real signals."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import pytest

from shared.localstack import LocalStack, _healthy, free_port
from shared.store import connect_redis

# Engines small and slowed down a little, so that streams are mid-flight when a fault strikes;
# a short drain, so that SIGTERM aborts what is still running soon (and teardown is quick).
ENGINE_ARGS = ["--threads", "1", "--num-kv-blocks", "512", "--lease-ttl", "3", "--debug-step-delay", "0.03",
               "--drain-timeout", "1"]


def make_stack(model_dir, log_dir, engines: int = 2, schedulers: int = 1, **kwargs) -> LocalStack:
    """A stack on an authenticated bus (each service with its role's credentials); a test's own
    connections use the admin's (`stack.infra.nats_url_as("admin")`)."""
    kwargs.setdefault("engine_args", ENGINE_ARGS)
    kwargs.setdefault("auth", True)
    return LocalStack(str(model_dir), engines=engines, schedulers=schedulers, log_dir=log_dir, **kwargs).start()


@dataclass
class Outcome:
    """How one streamed request ended, as the client saw it."""

    status: int
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    error: dict | None = None
    strata: dict = field(default_factory=dict)
    events: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None


async def stream_completion(http: aiohttp.ClientSession, base_url: str, api_key: str, body: dict,
                            timeout: float = 120.0, on_event=None) -> Outcome:
    """POST a streaming completion and read it to the end (or to its in-band error)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}", "Strata-Timeout": str(timeout)}
    async with http.post(base_url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            return Outcome(resp.status, error=(await resp.json()).get("error"))
        out = Outcome(200)
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            out.events += 1
            if "error" in event:
                out.error = event["error"]
                break
            for choice in event.get("choices", []):
                out.text += choice.get("text", "")
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            out.usage = event.get("usage") or out.usage
            out.strata = event.get("strata") or out.strata
            if on_event is not None:
                on_event(out)
        return out


async def metric(base_url: str, name: str, **labels) -> float:
    """Sum of a Prometheus metric's samples (those matching the labels) at base_url/metrics."""
    async with aiohttp.ClientSession() as http, http.get(base_url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_gateway(stack: LocalStack, name: str, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """One more gateway replica of the stack, on its own port (LocalStack starts one); returns
    once it answers."""
    port = free_port()
    with open(stack.log_dir / f"{name}.log", "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--model", stack.model_dir, "--served-model-name",
             stack.deployment, "--port", str(port), "--gateway-id", name, "--nats-url", stack.infra.nats_url,
             "--redis-url", stack.infra.redis_url, "--log-format", "json"],
            stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **stack.infra.env_for("gateway")})
    stack.services[name] = proc
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start (logs in {stack.log_dir})")
        time.sleep(0.2)
    return proc, url


@dataclass
class Record:
    gateway: str
    started: float  # monotonic
    ended: float
    outcome: Outcome


class Load:
    """`concurrency` clients that keep streaming completions through the given gateways (round
    robin) until stopped; every request's outcome is kept. A request that outlives its deadline
    by more than `grace` seconds is recorded as hung (status -1); a refused connection (a dead
    gateway) as status 0."""

    def __init__(self, gateways: list[str], api_key: str, concurrency: int = 8, max_tokens: int = 24,
                 timeout: float = 30.0, grace: float = 15.0):
        self.gateways, self.api_key, self.concurrency = gateways, api_key, concurrency
        self.max_tokens, self.timeout, self.grace = max_tokens, timeout, grace
        self.records: list[Record] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Load:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stopping.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), self.timeout + self.grace + 10)
        await self._http.close()

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stopping.is_set():
            gateway = self.gateways[(i + n) % len(self.gateways)]
            body = {"model": "tiny-llama", "prompt": f"Client {i} asks question {n}: why is the sky",
                    "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
            n += 1
            started = time.monotonic()
            try:
                outcome = await asyncio.wait_for(
                    stream_completion(self._http, gateway, self.api_key, body, timeout=self.timeout),
                    self.timeout + self.grace)
            except asyncio.TimeoutError:
                outcome = Outcome(-1, error={"message": "hung past its deadline"})
            except aiohttp.ClientError as exc:
                outcome = Outcome(0, error={"message": f"{exc.__class__.__name__}: {exc}"})
                await asyncio.sleep(0.2)
            self.records.append(Record(gateway, started, time.monotonic(), outcome))

    def summary(self) -> str:
        ok = sum(r.outcome.ok for r in self.records)
        hung = sum(r.outcome.status == -1 for r in self.records)
        return f"{len(self.records)} requests: {ok} completed, {len(self.records) - ok - hung} errors, {hung} hung"


@pytest.fixture
async def redis(stack):
    """A client of the module's `stack` store (through its Sentinels where it has them, with the
    services' retries across restarts)."""
    r = connect_redis(stack.infra.redis_url)
    yield r
    await r.aclose()
