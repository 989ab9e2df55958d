"""The dashboard in headless Chromium against a running stack: it asks for a key, says when
the key is wrong, then shows live figures from real traffic; the screenshot goes to docs/.

Chromium is driven over the DevTools protocol (a websocket): the test reads the page's DOM
until the figures are live, and every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from shared.localstack import LocalStack

pytestmark = pytest.mark.slow

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
WIDTH, HEIGHT = 1400, 900

# What the test reads from the page: the status pill, the prompt and error banner, the live
# figures (replica rows, KPIs, chart points, the layer breakdown) and any key left in the URL.
READ_PAGE = """JSON.stringify({
  status: document.getElementById("status").dataset.state,
  prompt: !document.getElementById("prompt").hidden,
  error: document.getElementById("error").hidden ? "" : document.getElementById("error").innerText,
  hash: location.hash,
  replicas: [...document.querySelectorAll("tr[data-replica]")].map((r) => r.dataset.state),
  requestRate: Number(document.getElementById("kpi-request-rate")?.dataset.value || 0),
  tokensPerS: Number(document.getElementById("kpi-tokens-per-s")?.dataset.value || 0),
  ttft: Number(document.getElementById("kpi-ttft")?.dataset.value || 0),
  points: Object.fromEntries([...document.querySelectorAll("svg[data-chart]")]
    .map((s) => [s.dataset.chart, Number(s.dataset.points)])),
  split: [...document.querySelectorAll("#traffic-split [data-revision]")]
    .map((d) => [d.dataset.revision, d.dataset.percent]),
  layerRequests: Number(document.getElementById("layers")?.dataset.requests || 0),
  runtimeSeconds: Number(document.querySelector('[data-layer="runtime"]')?.dataset.seconds || 0),
  tabs: [...document.querySelectorAll(".tab")].map((t) => t.dataset.deployment),
  cards: Object.fromEntries(["request-rate", "tokens-per-s", "ttft", "itl"].map((k) =>
    [k, document.getElementById(`kpi-${k}`)?.dataset.value ?? null])),
  chartNow: Object.fromEntries([...document.querySelectorAll("svg[data-chart]")]
    .map((s) => [s.dataset.chart, s.dataset.now])),
  analysis: document.getElementById("canary-analysis") ? {
    status: document.getElementById("canary-analysis").dataset.status,
    step: document.getElementById("canary-analysis").dataset.step,
    verdict: document.getElementById("canary-verdict")?.innerText || ""} : null,
})"""


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.next_id = 0
        self.exceptions: list[str] = []

    async def call(self, method: str, timeout: float = 15.0, **params) -> dict:
        self.next_id += 1
        call_id = self.next_id
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.ws.receive()
                if msg.type != aiohttp.WSMsgType.TEXT:
                    raise RuntimeError(f"DevTools connection closed during {method}: {msg.type}")
                data = json.loads(msg.data)
                if data.get("method") == "Runtime.exceptionThrown":
                    details = data["params"]["exceptionDetails"]
                    self.exceptions.append(details.get("exception", {}).get("description") or details.get("text", ""))
                if data.get("id") == call_id:
                    if "error" in data:
                        raise RuntimeError(f"{method}: {data['error']}")
                    return data["result"]

    async def read_page(self) -> dict:
        result = await self.call("Runtime.evaluate", expression=READ_PAGE, returnByValue=True)
        if "exceptionDetails" in result:
            return {}  # the page is between documents
        return json.loads(result["result"]["value"])

    async def wait_for(self, what: str, check, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        page: dict = {}
        while time.monotonic() < deadline:
            page = await self.read_page()
            if page and check(page):
                return page
            await asyncio.sleep(0.5)
        raise AssertionError(f"the dashboard did not show {what} within {timeout:.0f} s; it shows {page}")


def start_chromium(binary: str, profile: Path) -> subprocess.Popen:
    # Its own process group, so the finally below ends Chromium's helper processes with it.
    return subprocess.Popen([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             "--disable-extensions", "--hide-scrollbars", "--mute-audio",
                             f"--window-size={WIDTH},{HEIGHT}", f"--user-data-dir={profile}",
                             "--remote-debugging-port=0", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def stop_chromium(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


async def page_websocket(proc: subprocess.Popen, profile: Path, http: aiohttp.ClientSession) -> str:
    """The page target's DevTools websocket URL, once Chromium has written its port."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "chromium did not open its DevTools port within 30 s"
        await asyncio.sleep(0.1)
    port = int(port_file.read_text().splitlines()[0])
    async with http.get(f"http://127.0.0.1:{port}/json/list", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        targets = await resp.json()
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


def send_traffic(stack: LocalStack, stop: threading.Event, errors: list[str], done: list[int]) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=30)
    i = 0
    while not stop.is_set():
        try:
            client.completions.create(model="tiny", prompt=f"the dashboard shows request {i}", max_tokens=24)
            done[0] += 1
        except openai.OpenAIError as exc:
            errors.append(repr(exc))
        i += 1
        stop.wait(0.05)


@pytest.fixture
def chromium() -> str:
    """Debian's Chromium: a failure, not a skip, where it is missing (CI installs it)."""
    binary = shutil.which("chromium")
    assert binary, ("Debian's chromium is needed for the dashboard test and is not installed: "
                    "apt-get install -y chromium (.ci/run installs it)")
    return binary


@pytest.fixture
def dashboard_stack(tiny_model_dir, tmp_path):
    with LocalStack(str(tiny_model_dir), engines=0, control=True, scaler=True,
                    scaler_args=["--engine-arg=--threads=1"], log_dir=tmp_path / "logs") as s:
        s.deploy({"name": "tiny", "model": str(tiny_model_dir), "replicas": {"min": 1, "max": 1}})
        s.wait_replicas("tiny", 1, timeout=90)
        yield s


async def test_dashboard_shows_live_figures(chromium, dashboard_stack, tmp_path):
    stop, errors, done = threading.Event(), [], [0]
    traffic = threading.Thread(target=send_traffic, args=(dashboard_stack, stop, errors, done), daemon=True)
    traffic.start()
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    browser = None
    try:
        browser = start_chromium(chromium, profile)
        async with aiohttp.ClientSession() as http:
            target = await page_websocket(browser, profile, http)
            async with http.ws_connect(target, max_msg_size=64 * 1024 * 1024,
                                       timeout=aiohttp.ClientWSTimeout(ws_close=10)) as ws:
                cdp = DevTools(ws)
                await cdp.call("Runtime.enable")
                await cdp.call("Page.enable")
                await cdp.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
                               deviceScaleFactor=1, mobile=False)
                dashboard = f"{dashboard_stack.control_url}/dashboard"

                # No key: a prompt that says how to give one.
                await cdp.call("Page.navigate", url=dashboard)
                await cdp.wait_for("the key prompt", lambda p: p["prompt"] and p["status"] == "nokey", 20)

                # A wrong key: the API's refusal, shown as such.
                await cdp.call("Page.navigate", url=f"{dashboard}#key=sk-strata-not-a-real-key")
                page = await cdp.wait_for("the rejected key", lambda p: p["status"] == "error" and p["error"], 20)
                assert "rejected" in page["error"] and "invalid API key" in page["error"], page
                assert page["prompt"] and page["hash"] == "", page

                # The admin key: live figures from the traffic, and the key gone from the URL.
                await cdp.call("Page.navigate", url=f"{dashboard}#key={dashboard_stack.api_key}")
                page = await cdp.wait_for(
                    "live figures",
                    lambda p: (p["status"] == "live" and p["replicas"] == ["ready"] and p["requestRate"] > 0
                               and p["tokensPerS"] > 0 and p["ttft"] > 0 and p["layerRequests"] > 0
                               and min(p["points"].get(c, 0) for c in ("request_rate", "tokens_per_s",
                                                                       "ttft_p90_s", "itl_p50_s")) >= 6),
                    45)
                assert page["hash"] == "" and not page["prompt"] and not page["error"], page
                assert page["split"] == [["1", "100"]], page
                assert page["runtimeSeconds"] > 0, page
                # The cards show what their charts end on (one poll: the same overview).
                for card, chart in (("request-rate", "request_rate"), ("tokens-per-s", "tokens_per_s"),
                                    ("ttft", "ttft_p90_s"), ("itl", "itl_p50_s")):
                    assert page["cards"][card] not in ("", None) and \
                        float(page["cards"][card]) == float(page["chartNow"][chart]), (card, page)

                # A deployment that is deleted leaves the dashboard (scaled to zero: it costs no engine).
                dashboard_stack.deploy({"name": "short-lived", "model": dashboard_stack.model_dir,
                                        "replicas": {"min": 0, "max": 1}})
                await cdp.wait_for("the new deployment's tab", lambda p: "short-lived" in p["tabs"], 20)
                dashboard_stack.client.delete("short-lived")
                page = await cdp.wait_for("the deleted deployment gone", lambda p: p["tabs"] == ["tiny"], 20)

                # A canary with an analysis: the panel shows its step and what it waits for.
                dashboard_stack.deploy({"name": "tiny", "model": dashboard_stack.model_dir,
                                        "replicas": {"min": 1, "max": 1},
                                        "canary": {"analysis": {"steps": [10, 50], "min_requests": 1000,
                                                                "interval_s": 1}}})
                page = await cdp.wait_for("the canary analysis", lambda p: p["analysis"] is not None and
                                          p["analysis"]["verdict"].startswith("wait at 10%"), 30)
                assert page["analysis"]["status"] == "running" and page["analysis"]["step"] == "10", page
                assert ["2", "10"] in page["split"], page
                await asyncio.sleep(2.5)  # one more poll before the screenshot
                assert not cdp.exceptions, cdp.exceptions

                shot = await cdp.call("Page.captureScreenshot", format="png")
        png = base64.b64decode(shot["data"])
        assert png.startswith(b"\x89PNG"), "the screenshot is not a PNG"
        (tmp_path / "dashboard.png").write_bytes(png)
        SCREENSHOT.parent.mkdir(exist_ok=True)
        SCREENSHOT.write_bytes(png)
    finally:
        if browser is not None:
            stop_chromium(browser)
        stop.set()
        traffic.join(40)
    assert done[0] > 0 and not errors, (done[0], errors[:5])
