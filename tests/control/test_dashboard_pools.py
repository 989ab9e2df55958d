"""The dashboard's capacity pools panel in headless Chromium: a real control service with two
stored pools and the scaler's report of them on the bus (one backed off after refusing, a
deployment short of capacity); the panel shows each pool's use, cost, refusals and state."""

import asyncio
import json
import time
import uuid

import aiohttp
import pytest

from services.control.pools import PoolStore
from services.control.service import ControlConfig, ControlService
from services.control.spec import validate
from services.control.store import DeploymentStore
from services.gateway.auth import create_key
from shared import protocol
from shared.bus import Bus
from shared.pools import parse_pool
from shared.protocol import PoolReport, PoolStatus
from shared.store import connect_redis
from tests.control.test_dashboard import (DevTools, chromium, page_websocket, start_chromium,  # noqa: F401 (fixture)
                                          stop_chromium)

pytestmark = pytest.mark.slow

READ_POOLS = """JSON.stringify({
  status: document.getElementById("status").dataset.state,
  pools: [...document.querySelectorAll("#pools tr[data-pool]")].map((r) => ({
    name: r.dataset.pool, used: Number(r.dataset.used), capacity: Number(r.dataset.capacity),
    refusals: Number(r.dataset.refusals), text: r.innerText})),
  short: [...document.querySelectorAll("#pools [data-short]")].map((p) => p.innerText),
})"""


async def test_the_pools_panel_shows_use_cost_refusals_and_shortage(chromium, infra, tiny_model_dir, tmp_path):  # noqa: F811
    suffix = uuid.uuid4().hex[:6]
    name, spot, dear = f"dash-{suffix}", f"spot-{suffix}", f"dear-{suffix}"
    redis = connect_redis(infra.redis_url)
    key = await create_key(redis, "dashboard-pools", admin=True)
    await DeploymentStore(redis).apply(validate({"name": name, "model": str(tiny_model_dir)}))
    for pool, cost in ((spot, 1.0), (dear, 3.5)):
        await PoolStore(redis).apply(parse_pool({"name": pool, "region": "east", "capacity": 4, "cost_per_hour": cost}))
    control = ControlService(ControlConfig(infra.nats_url, infra.redis_url, port=0, control_id="dash-pools"))
    await control.start()
    bus = await Bus.connect(infra.nats_url, "test-dashboard-pools")
    status = PoolStatus(scaler_id="scaler-dash", short={name: 2}, wanted={name: 8}, pools=[
        PoolReport(name=spot, region="east", kind="local", capacity=4, effective_capacity=2, used=2, ready=2,
                   cost_per_hour=1.0, cold_start_s=12.0, refusals=3, backoff_s=40.0,
                   last_refusal="local pool at its limit of 2 engines", deployments={name: 2}),
        PoolReport(name=dear, region="east", kind="local", capacity=4, effective_capacity=4, used=4, ready=3,
                   starting=1, cost_per_hour=3.5, cold_start_s=10.0, deployments={name: 4})])

    async def report() -> None:
        while True:
            status.timestamp = time.time()
            await bus.publish(protocol.SCALER_POOLS, status)
            await asyncio.sleep(1.0)

    reporter = asyncio.create_task(report())
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    browser = start_chromium(chromium, profile)
    try:
        async with aiohttp.ClientSession() as http:
            target = await page_websocket(browser, profile, http)
            async with http.ws_connect(target, max_msg_size=64 * 1024 * 1024,
                                       timeout=aiohttp.ClientWSTimeout(ws_close=10)) as ws:
                cdp = DevTools(ws)
                await cdp.call("Runtime.enable")
                await cdp.call("Page.navigate", url=f"{control.url}/dashboard#key={key}")
                deadline = time.monotonic() + 30
                while True:
                    result = await cdp.call("Runtime.evaluate", expression=READ_POOLS, returnByValue=True)
                    page = json.loads(result["result"].get("value") or "{}")
                    if page.get("pools") and len(page["pools"]) == 2 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.5)
                assert not cdp.exceptions, cdp.exceptions
    finally:
        stop_chromium(browser)
        reporter.cancel()
        await bus.close()
        await control.stop()
        await DeploymentStore(redis).delete(name)
        for pool in (spot, dear):
            await PoolStore(redis).delete(pool)
        await redis.aclose()
    rows = {p["name"]: p for p in page["pools"]}
    assert page["status"] == "live" and set(rows) == {spot, dear}, page
    assert (rows[spot]["used"], rows[spot]["capacity"], rows[spot]["refusals"]) == (2, 4, 3)
    assert "2/4" in rows[spot]["text"] and "backed off 40 s" in rows[spot]["text"]
    assert "$14.00" in rows[dear]["text"] and "3/1/0" in rows[dear]["text"] and "full" in rows[dear]["text"]
    assert page["short"] == [f"short {name}: 2 of 8 wanted replicas fit in no pool it may use"]
