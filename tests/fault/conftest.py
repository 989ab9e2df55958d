"""Fault injection on a real local stack: each test module gets its own NATS and Valkey (a test
that restarts them must not disturb any other), engines on the tiny model with one torch thread,
and real processes killed with real signals."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from shared.localstack import LocalStack, free_port

# Engines small and slowed down a little, so that streams are mid-flight when a fault strikes.
ENGINE_ARGS = ["--threads", "1", "--num-kv-blocks", "512", "--lease-ttl", "3", "--debug-step-delay", "0.03"]


def make_stack(model_dir, log_dir, engines: int = 2, schedulers: int = 1, **kwargs) -> LocalStack:
    kwargs.setdefault("engine_args", ENGINE_ARGS)
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


def start_gateway(stack: LocalStack, name: str) -> tuple[subprocess.Popen, str]:
    """One more gateway replica of the stack, on its own port (LocalStack starts one)."""
    port = free_port()
    with open(stack.log_dir / f"{name}.log", "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--model", stack.model_dir, "--served-model-name",
             stack.deployment, "--port", str(port), "--gateway-id", name, "--nats-url", stack.infra.nats_url,
             "--redis-url", stack.infra.redis_url, "--log-format", "json"],
            stdout=log_file, stderr=subprocess.STDOUT)
    stack.services[name] = proc
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")
