"""Deployments in Redis: immutable numbered revisions and the live state that points at them.

    strata:deployments                       set of names
    strata:deployment:<name>                 hash: latest, stable, canary, canary_weight,
                                             routing_policy, generation, updated_at
    strata:deployment:<name>:revision:<n>    the spec of revision n (JSON), never rewritten
    strata:deployment:<name>:history         list of change events (JSON)
    strata:deployment:<name>:deleted         tombstone of a deleted deployment (a day)
    strata:deployment:<name>:analysis        the canary analysis of the current canary (JSON)

Every change is one optimistic transaction (WATCH on the state hash), so several control
replicas can serve the API at once. Readers (`read_state`, `read_spec`) are used by the
gateway, schedulers and scaler too.
"""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from shared import keys
from shared.deployments import Deployment, DeploymentSpec, DeploymentState, history, read_spec, read_state

HISTORY_LIMIT = 200
TOMBSTONE_TTL_S = 86400  # a deleted deployment's tombstone: long enough for every reader's resync


class DeploymentError(Exception):
    """An operation that cannot be done to the deployment in its current state."""

    def __init__(self, status: int, message: str, code: str = "invalid_request"):
        self.status, self.code = status, code
        super().__init__(message)


class DeploymentStore:
    def __init__(self, redis: aioredis.Redis):
        self.redis = redis

    async def _change(self, name: str, action: str, change, actor: str = "", details: dict | None = None
                      ) -> DeploymentState:
        """Run change(state) -> (new state, new spec or None) atomically; records history (with
        `details`, e.g. the canary analysis' verdict and figures, under `analysis`)."""
        key = keys.deployment(name)
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await pipe.hgetall(key)
                    current = DeploymentState.from_hash(name, raw) if raw else None
                    state, new_spec = await change(current)
                    state.generation = (current.generation if current else 0) + 1
                    state.updated_at = time.time()
                    event = {"at": state.updated_at, "action": action, "actor": actor, "stable": state.stable,
                             "canary": state.canary, "canary_weight": state.canary_weight,
                             "generation": state.generation}
                    if details is not None:
                        event["analysis"] = details
                    pipe.multi()
                    if new_spec is not None:
                        event["revision"] = state.latest
                        pipe.set(keys.deployment_revision(name, state.latest), new_spec.to_json())
                    pipe.hset(key, mapping=state.to_hash())
                    pipe.sadd(keys.DEPLOYMENTS, name)
                    pipe.delete(keys.deployment_deleted(name))
                    pipe.rpush(keys.deployment_history(name), json.dumps(event))
                    pipe.ltrim(keys.deployment_history(name), -HISTORY_LIMIT, -1)
                    await pipe.execute()
                    return state
                except WatchError:
                    continue  # someone else changed it meanwhile: redo on the new state

    async def apply(self, spec: DeploymentSpec, actor: str = "") -> DeploymentState:
        """A new revision. The first one, or one with canary weight 0, takes all traffic; one
        with a weight starts as the canary beside the stable revision."""
        async def change(current: DeploymentState | None):
            state = current or DeploymentState(spec.name)
            state.latest += 1
            if state.stable and spec.canary_weight:
                state.canary, state.canary_weight = state.latest, spec.canary_weight
            else:
                state.stable, state.canary, state.canary_weight = state.latest, 0, 0
                state.routing_policy = spec.routing_policy
            return state, spec

        return await self._change(spec.name, "apply", change, actor)

    async def adapters_only(self, spec: DeploymentSpec) -> bool:
        """Whether `spec` differs from the serving stable revision in its adapters alone (and
        starts no canary): then it is applied live, without a new revision."""
        state = await read_state(self.redis, spec.name)
        if state is None or not state.stable or state.canary or spec.canary_weight:
            return False
        stable = await read_spec(self.redis, spec.name, state.stable)
        return stable is not None and stable.without_adapters() == spec.without_adapters()

    async def record_adapters(self, name: str, actor: str = "") -> DeploymentState:
        """A change of the live adapters: the generation moves (readers re-read) and history
        records it; the revisions stay as they are."""
        async def change(current: DeploymentState | None):
            return self._existing(name, current), None

        return await self._change(name, "adapters", change, actor)

    async def set_canary(self, name: str, weight: int, revision: int | None = None,
                         actor: str = "") -> DeploymentState:
        if not 0 <= weight <= 100:
            raise DeploymentError(400, "weight must be a percentage from 0 to 100")

        async def change(current: DeploymentState | None):
            state = self._existing(name, current)
            target = revision or state.canary
            if not target:
                raise DeploymentError(409, f"deployment {name} has no canary revision: deploy one first, or "
                                           f"name one with --revision")
            if not 1 <= target <= state.latest or target == state.stable:
                raise DeploymentError(400, f"revision {target} is not a candidate canary of {name} "
                                           f"(revisions 1-{state.latest}, stable {state.stable})")
            state.canary, state.canary_weight = target, weight
            return state, None

        return await self._change(name, "canary", change, actor)

    async def promote(self, name: str, actor: str = "") -> DeploymentState:
        async def change(current: DeploymentState | None):
            state = self._existing(name, current)
            if not state.canary:
                raise DeploymentError(409, f"deployment {name} has no canary to promote")
            return await self._promoted(name, state), None

        return await self._change(name, "promote", change, actor)

    async def _promoted(self, name: str, state: DeploymentState) -> DeploymentState:
        spec = await read_spec(self.redis, name, state.canary)
        state.stable, state.canary, state.canary_weight = state.canary, 0, 0
        state.routing_policy = spec.routing_policy if spec else state.routing_policy
        return state

    async def analysis_step(self, name: str, canary: int, weight_before: int, action: str, weight: int,
                            details: dict, actor: str = "canary-analysis") -> DeploymentState:
        """The canary analysis acts: `canary` (a new weight), `promote` or `rollback`, only if the
        canary and its weight are still what it judged (else 409: someone changed them meanwhile)."""
        async def change(current: DeploymentState | None):
            state = self._existing(name, current)
            if (state.canary, state.canary_weight) != (canary, weight_before):
                raise DeploymentError(409, f"deployment {name} changed during the analysis (canary r{state.canary} "
                                           f"at {state.canary_weight}%, judged r{canary} at {weight_before}%)")
            if action == "promote":
                return await self._promoted(name, state), None
            if action == "rollback":
                state.canary, state.canary_weight = 0, 0
            else:
                state.canary_weight = weight
            return state, None

        if action not in ("canary", "promote", "rollback"):
            raise ValueError(f"unknown analysis action {action!r}")
        return await self._change(name, action, change, actor, details)

    async def rollback(self, name: str, to: int | None = None, actor: str = "") -> DeploymentState:
        """Without `to`: drop the canary if there is one, else go back to the previous stable
        revision. With `to`: that revision takes all traffic."""
        async def change(current: DeploymentState | None):
            state = self._existing(name, current)
            target = to
            if target is None and state.canary:
                state.canary, state.canary_weight = 0, 0
                return state, None
            if target is None:
                target = await self._previous_stable(name, state.stable)
                if target is None:
                    raise DeploymentError(409, f"deployment {name} has no earlier revision to roll back to")
            if not 1 <= target <= state.latest:
                raise DeploymentError(404, f"deployment {name} has no revision {target} "
                                           f"(revisions 1-{state.latest})", "not_found")
            spec = await read_spec(self.redis, name, target)
            state.stable, state.canary, state.canary_weight = target, 0, 0
            state.routing_policy = spec.routing_policy if spec else state.routing_policy
            return state, None

        return await self._change(name, "rollback", change, actor)

    async def _previous_stable(self, name: str, current: int) -> int | None:
        """The stable revision before the current one took over."""
        stables = [e["stable"] for e in await history(self.redis, name)]
        # Walk back past the current stable's own entries to the one before it.
        for rev in reversed(stables):
            if rev and rev != current:
                return rev
        return None

    async def delete(self, name: str) -> None:
        state = await read_state(self.redis, name)
        if state is None:
            raise DeploymentError(404, f"deployment {name} does not exist", "not_found")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.deployment(name), keys.deployment_history(name), keys.deployment_analysis(name),
                        keys.lora_adapters(name))
            for rev in range(1, state.latest + 1):
                pipe.delete(keys.deployment_revision(name, rev))
            pipe.srem(keys.DEPLOYMENTS, name)
            # Readers drop their copy only for this: a deployment merely missing was lost, not deleted.
            pipe.set(keys.deployment_deleted(name), state.generation, ex=TOMBSTONE_TTL_S)
            await pipe.execute()

    async def restore(self, deployment: Deployment, actor: str = "") -> bool:
        """Write back a deployment the store lost (its state and the specs of the revisions it
        serves, as a reader held them), unless it is there or was deleted; True if restored."""
        name, state = deployment.state.name, deployment.state
        key = keys.deployment(name)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key, keys.deployment_deleted(name))
                if await pipe.exists(key) or await pipe.exists(keys.deployment_deleted(name)):
                    return False
                event = {"at": time.time(), "action": "restore", "actor": actor, "stable": state.stable,
                         "canary": state.canary, "canary_weight": state.canary_weight,
                         "generation": state.generation}
                pipe.multi()
                for rev, spec in deployment.specs.items():
                    pipe.set(keys.deployment_revision(name, rev), spec.to_json(), nx=True)
                pipe.hset(key, mapping=state.to_hash())
                pipe.sadd(keys.DEPLOYMENTS, name)
                pipe.rpush(keys.deployment_history(name), json.dumps(event))
                await pipe.execute()
                return True
            except WatchError:  # written meanwhile (another control restored it, or a change)
                return False

    @staticmethod
    def _existing(name: str, current: DeploymentState | None) -> DeploymentState:
        if current is None or not current.stable:
            raise DeploymentError(404, f"deployment {name} does not exist", "not_found")
        return current
