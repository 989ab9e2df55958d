"""Fixtures of the engine worker tests: a client on the real NATS and one on the real Valkey,
one of each per test module."""

import pytest

from shared.bus import Bus
from shared.store import connect_redis


@pytest.fixture(scope="module")
async def bus(infra):
    b = await Bus.connect(infra.nats_url, "test-worker")
    yield b
    await b.close()


@pytest.fixture(scope="module")
async def redis(infra):
    r = connect_redis(infra.redis_url)
    yield r
    await r.aclose()
