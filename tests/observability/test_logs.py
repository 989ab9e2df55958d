"""`strata logs`: log lines of every service over NATS, followed by request id; the tap never blocks."""

import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import nats

from shared import protocol
from shared.logstream import LogPublisher, LogTap
from shared.protocol import LogLine

MODEL = "tiny-b"


class Follower:
    """`strata logs ...` as a process; its lines are read on a thread."""

    def __init__(self, stack, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "services.control.cli", "logs", "--json",
                                      "--nats-url", stack.infra.nats_url, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def collect(self, done, timeout: float = 20.0) -> list[dict]:
        got, deadline = [], time.monotonic() + timeout
        while not done(got) and time.monotonic() < deadline:
            try:
                got.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                pass
        return got

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(10)


async def complete(stack, prompt: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 3},
                             headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
            assert resp.status == 200
            return resp.headers["x-request-id"]


def services_seen(lines: list[dict]) -> set[str]:
    return {line["service"] for line in lines}


async def test_one_request_followed_across_gateway_scheduler_and_engine(obs_stack):
    rid = await complete(obs_stack, "Follow me")
    other = await complete(obs_stack, "Not me")
    # After the fact: --since replays the last minute from JetStream, then follows live.
    follower = Follower(obs_stack, "--request", rid, "--since", "1m")
    lines = await asyncio.to_thread(follower.collect, lambda got: services_seen(got) >= {"gateway", "scheduler",
                                                                                          "engine"})
    assert follower.stop() == 0
    assert services_seen(lines) == {"gateway", "scheduler", "engine"}, lines
    assert all(line["request_id"] == rid for line in lines) and other != rid
    events = {(line["service"], line["event"]) for line in lines}
    assert {("gateway", "request served"), ("scheduler", "routed"), ("engine", "request finished")} <= events
    served = next(line for line in lines if line["event"] == "request served")
    assert served["status"] == 200 and set(served["timings_ms"]) >= {"admission_wait", "engine_decode", "e2e"}
    finished = next(line for line in lines if line["event"] == "request finished")
    assert finished["completion_tokens"] == 3 and finished["instance"] in ("engine-b0", "engine-b1")


async def test_live_follow_of_one_service(obs_stack):
    follower = Follower(obs_stack, "--service", "engine")
    await asyncio.sleep(1.0)  # subscribed
    rid = await complete(obs_stack, "Live")
    lines = await asyncio.to_thread(follower.collect, lambda got: any(line.get("request_id") == rid for line in got))
    assert follower.stop() == 0
    assert any(line.get("request_id") == rid and line["event"] == "request finished" for line in lines)
    assert services_seen(lines) == {"engine"}


async def test_the_tap_is_bounded_and_never_recurses_on_its_own_errors(infra):
    tap = LogTap(max_pending=3)
    tap.enabled = True
    for i in range(5):
        tap(None, "info", {"event": f"line {i}", "level": "info", "timestamp": "t", "obj": object()})
    assert len(tap.pending) == 3 and tap.dropped == 2

    nc = await nats.connect(infra.nats_url)
    received: list[LogLine] = []

    async def on_line(msg) -> None:
        received.append(protocol.decode(LogLine, msg.data))

    sub = await nc.subscribe(protocol.logs("test", "*"), cb=on_line)
    publisher = LogPublisher(await nats.connect(infra.nats_url), "test", "unit.1", tap=tap)
    await publisher.drain()
    await nc.flush()
    deadline = time.monotonic() + 5
    while len(received) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert [line.event for line in received] == ["line 0", "line 1", "line 2", "log lines dropped"]
    assert received[0].instance == "unit_1" and received[0].fields["obj"].startswith("<object")
    assert received[3].fields["dropped"] == 2
    await sub.unsubscribe()
    await nc.close()

    # NATS gone: publishing fails, is counted, and puts nothing back in the tap.
    await publisher.nc.close()
    tap(None, "info", {"event": "after close", "level": "info", "timestamp": "t"})
    await publisher.drain()
    assert publisher.failed == 1 and not tap.pending

