"""The prefix index in Redis: block hash -> replicas, replica -> hashes, fed by KV events.

Every scheduler hears every engine's KV event batches and applies them through one Lua script
that checks the batch's seq against the last one applied: a batch already applied (by another
scheduler) is skipped, a gap makes the caller resync from the engine's snapshot. So several
schedulers share one exact index, and a lost or reordered batch never leaves it stale.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import keys

# How long one scheduler's resync of a replica keeps the others from starting their own (the
# snapshot request times out within it). A scheduler killed mid-resync leaves its lock this long,
# and meanwhile that replica's index stays behind: short, since a second resync is only waste.
RESYNC_LOCK_TTL_S = 2.0

# The seq key holds "<epoch>:<seq>": the engine process incarnation and its last applied batch.
# KEYS: seq key, replica set key. ARGV: replica, epoch, seq, prefix key prefix, n_stored, stored..., removed...
_APPLY = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 'gap' end
local sep = string.find(cur, ':', 1, true)
if string.sub(cur, 1, sep - 1) ~= ARGV[2] then return 'gap' end
cur = tonumber(string.sub(cur, sep + 1))
local seq = tonumber(ARGV[3])
if seq <= cur then return 'dup' end
if seq > cur + 1 then return 'gap' end
local replica, prefix, n = ARGV[1], ARGV[4], tonumber(ARGV[5])
for i = 6, 5 + n do
  redis.call('SADD', prefix .. ARGV[i], replica)
  redis.call('SADD', KEYS[2], ARGV[i])
end
for i = 6 + n, #ARGV do
  redis.call('SREM', prefix .. ARGV[i], replica)
  redis.call('SREM', KEYS[2], ARGV[i])
end
redis.call('SET', KEYS[1], ARGV[2] .. ':' .. seq)
return 'ok'
"""

# KEYS: seq key, replica set key. ARGV: replica, "<epoch>:<seq>" (or "" to delete), prefix,
# only_if_newer (1/0), hashes... With only_if_newer, a state of the same epoch at the same or a
# later seq wins (another scheduler got there first): nothing changes.
_REPLACE = """
local replica, prefix = ARGV[1], ARGV[3]
if ARGV[4] == '1' then
  local cur = redis.call('GET', KEYS[1])
  if cur then
    local sep, new_sep = string.find(cur, ':', 1, true), string.find(ARGV[2], ':', 1, true)
    if string.sub(cur, 1, sep - 1) == string.sub(ARGV[2], 1, new_sep - 1)
       and tonumber(string.sub(cur, sep + 1)) >= tonumber(string.sub(ARGV[2], new_sep + 1)) then
      return 'stale'
    end
  end
end
for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('SREM', prefix .. h, replica)
end
redis.call('DEL', KEYS[2])
for i = 5, #ARGV do
  redis.call('SADD', prefix .. ARGV[i], replica)
  redis.call('SADD', KEYS[2], ARGV[i])
end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2]) end
return 'ok'
"""


def _prefix(model: str) -> str:
    return keys.prefix_block(model, 0)[:-1]  # "strata:prefix:<model>:"


class PrefixIndex:
    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self._apply = redis.register_script(_APPLY)
        self._replace = redis.register_script(_REPLACE)

    async def apply(self, model: str, replica_id: str, epoch: str, seq: int, stored: list[int],
                    removed: list[int]) -> str:
        """'ok', 'dup' (already applied) or 'gap' (resync needed)."""
        result = await self._apply(
            keys=[keys.replica_blocks_seq(model, replica_id), keys.replica_blocks(model, replica_id)],
            args=[replica_id, epoch, seq, _prefix(model), len(stored), *stored, *removed])
        return result.decode() if isinstance(result, bytes) else result

    async def replace(self, model: str, replica_id: str, epoch: str, seq: int, hashes) -> str:
        """Make the index hold exactly `hashes` for this replica, as of its event batch `seq`,
        unless it already holds that state or a later one ('stale')."""
        result = await self._replace(
            keys=[keys.replica_blocks_seq(model, replica_id), keys.replica_blocks(model, replica_id)],
            args=[replica_id, f"{epoch}:{seq}", _prefix(model), 1, *hashes])
        return result.decode() if isinstance(result, bytes) else result

    async def remove_replica(self, model: str, replica_id: str) -> None:
        await self._replace(keys=[keys.replica_blocks_seq(model, replica_id), keys.replica_blocks(model, replica_id)],
                            args=[replica_id, "", _prefix(model), 0])

    async def unindexed(self, model: str, replica_ids: list[str]) -> list[str]:
        """Replicas with no index state at all (the store was emptied, or they are new): they
        need a resync from their snapshot, even if no KV event of theirs reveals a gap."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for replica_id in replica_ids:
                pipe.exists(keys.replica_blocks_seq(model, replica_id))
            found = await pipe.execute()
        return [r for r, exists in zip(replica_ids, found) if not exists]

    async def try_lock_resync(self, model: str, replica_id: str, ttl_s: float = RESYNC_LOCK_TTL_S) -> bool:
        return bool(await self.redis.set(keys.resync_lock(model, replica_id), b"1", nx=True, px=int(ttl_s * 1000)))

    async def unlock_resync(self, model: str, replica_id: str) -> None:
        await self.redis.delete(keys.resync_lock(model, replica_id))

    async def holders(self, model: str, hashes: list[int]) -> list[set[str]]:
        """For each block hash, the replicas holding it: one round trip."""
        if not hashes:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.smembers(keys.prefix_block(model, h))
            sets = await pipe.execute()
        return [{m.decode() for m in s} for s in sets]
