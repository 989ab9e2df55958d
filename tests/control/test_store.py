"""Deployments in a real Valkey: numbered immutable revisions, canary, promote, rollback."""

import asyncio
import uuid

import pytest

from services.control.spec import validate
from services.control.store import DeploymentError, DeploymentStore
from shared import deployments
from shared.store import connect_redis


@pytest.fixture
async def store(infra):
    """A store on the session's Valkey; the deployments a test made are deleted after it (other
    tests' gateways and scalers share this Valkey and would serve and scale them)."""
    redis = connect_redis(infra.redis_url)
    before = set(await deployments.list_names(redis))
    yield DeploymentStore(redis)
    for name in set(await deployments.list_names(redis)) - before:
        await DeploymentStore(redis).delete(name)
    await redis.aclose()


def spec(model_dir, name, weight=0, max_replicas=2):
    return validate({"name": name, "model": str(model_dir), "replicas": {"min": 1, "max": max_replicas},
                     "canary": {"weight": weight}})


async def test_apply_canary_promote_rollback(store, tiny_model_dir):
    name = f"dep-{uuid.uuid4().hex[:6]}"
    s1 = await store.apply(spec(tiny_model_dir, name))
    assert (s1.latest, s1.stable, s1.canary) == (1, 1, 0)
    assert s1.serving() == {1: 100}

    s2 = await store.apply(spec(tiny_model_dir, name, weight=20, max_replicas=5))
    assert (s2.latest, s2.stable, s2.canary, s2.canary_weight) == (2, 1, 2, 20)
    assert s2.serving() == {1: 80, 2: 20}
    assert s2.revision_for(0.1) == 2 and s2.revision_for(0.5) == 1

    s3 = await store.set_canary(name, 50)
    assert s3.serving() == {1: 50, 2: 50}

    dropped = await store.rollback(name)  # with a canary: drop it
    assert dropped.serving() == {1: 100}

    await store.set_canary(name, 30, revision=2)
    promoted = await store.promote(name)
    assert promoted.serving() == {2: 100}

    back = await store.rollback(name)  # no canary: the previous stable revision
    assert back.serving() == {1: 100}
    named = await store.rollback(name, to=2)
    assert named.serving() == {2: 100}

    # Revisions are immutable: revision 1 still has its own spec.
    assert (await deployments.read_spec(store.redis, name, 1)).replicas.max == 2
    assert (await deployments.read_spec(store.redis, name, 2)).replicas.max == 5
    events = await deployments.history(store.redis, name)
    assert [e["action"] for e in events] == ["apply", "apply", "canary", "rollback", "canary", "promote",
                                             "rollback", "rollback"]
    assert [e["generation"] for e in events] == list(range(1, 9))

    loaded = await deployments.load(store.redis, name)
    assert loaded.state.stable == 2 and loaded.stable_spec.replicas.max == 5


async def test_refusals_change_nothing(store, tiny_model_dir):
    name = f"dep-{uuid.uuid4().hex[:6]}"
    with pytest.raises(DeploymentError) as info:
        await store.promote(name)
    assert info.value.status == 404
    await store.apply(spec(tiny_model_dir, name))
    before = await deployments.read_state(store.redis, name)
    for op, status in ((store.promote(name), 409), (store.set_canary(name, 10), 409),
                       (store.rollback(name), 409), (store.rollback(name, to=7), 404),
                       (store.set_canary(name, 10, revision=1), 400), (store.set_canary(name, 101), 400)):
        with pytest.raises(DeploymentError) as info:
            await op
        assert info.value.status == status, str(info.value)
    assert await deployments.read_state(store.redis, name) == before


async def test_concurrent_applies_get_distinct_revisions(store, tiny_model_dir):
    name = f"dep-{uuid.uuid4().hex[:6]}"
    states = await asyncio.gather(*(store.apply(spec(tiny_model_dir, name, max_replicas=i + 1)) for i in range(6)))
    assert sorted(s.latest for s in states) == list(range(1, 7))
    final = await deployments.read_state(store.redis, name)
    assert final.latest == 6 and final.generation == 6


async def test_delete(store, tiny_model_dir):
    name = f"dep-{uuid.uuid4().hex[:6]}"
    await store.apply(spec(tiny_model_dir, name))
    assert name in await deployments.list_names(store.redis)
    await store.delete(name)
    assert name not in await deployments.list_names(store.redis)
    assert await deployments.read_state(store.redis, name) is None
    assert await deployments.read_spec(store.redis, name, 1) is None
