"""Paged KV block allocation with reference counts and a prefix cache.

Every full block that has been computed gets a hash chained from its parent's (see
shared.block_hash); any later request whose prompt starts with the same tokens reuses it.
Free blocks sit in an LRU list; a free block that still holds cached KV is only evicted when a
new block is needed, oldest first. Every block that enters or leaves the cache is recorded as a
KV event, which the worker publishes so the router can build its prefix index.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.engine.sequence import Sequence
from shared.block_hash import ROOT_HASH, hash_block

NO_HASH = -1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int = NO_HASH
    parent_hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()
    root_hash: int = ROOT_HASH  # the chain it belongs to (a LoRA adapter's, or the base model's)


@dataclass
class KvEvents:
    """Blocks stored in / removed from the prefix cache since the last drain."""

    stored: list[tuple[int, int | None]] = field(default_factory=list)  # (hash, parent hash or None)
    removed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.events = KvEvents()
        self.prefix_cache_queries = 0  # prompt tokens looked up (first admission only)
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def cached_block_hashes(self) -> set[int]:
        return set(self.cached)

    def blocks_needed_for_admission(self, num_cached_blocks: int, num_new_tokens: int) -> int:
        total = num_cached_blocks * self.block_size + num_new_tokens
        return max(-(-total // self.block_size) - num_cached_blocks, 0)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(-(-total // self.block_size) - len(seq.block_table), 0)

    # ---- prefix cache -----------------------------------------------------------------------
    def block_hash_at(self, seq: Sequence, i: int) -> int:
        """Hash of seq's i-th full block; memoized on the seq (its tokens never change)."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[-1] if hashes else seq.hash_root
            hashes.append(hash_block(parent, seq.token_ids[j * self.block_size:(j + 1) * self.block_size]))
        return hashes[i]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that cover the longest prefix of seq (the last token is never cached:
        its logits are needed). Nothing for a request that asks for prompt logprobs: every prompt
        position's logits are needed."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(self.block_hash_at(seq, i))
            if block_id is None:
                break
            tokens = self.blocks[block_id].token_ids
            if tokens != tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]):
                break  # a 64-bit collision: treat as a miss
            hits.append(block_id)
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> bool:
        """Give a waiting seq its cached prefix blocks plus blocks for num_new_tokens more tokens.
        All or nothing: returns False (changing nothing) if there are not enough free blocks."""
        evictable_hits = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        num_cached_tokens = len(cached_blocks) * self.block_size
        fresh = self.blocks_needed_for_admission(len(cached_blocks), num_new_tokens)
        if fresh + evictable_hits > self.num_free_blocks:
            return False
        for block_id in cached_blocks:
            self._ref(block_id)
        seq.block_table = list(cached_blocks)
        seq.num_computed_tokens = num_cached_tokens
        if seq.num_cached_tokens < 0:  # first admission: count it; recomputation after preemption is not a hit
            seq.num_cached_tokens = num_cached_tokens
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += num_cached_tokens
        self._append_fresh(seq, fresh)
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of a running seq; False if out of blocks."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        self._append_fresh(seq, needed)
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None | bool:
        """Give child (a new choice of parent's request: the same first tokens) parent's KV for
        its first num_tokens tokens: the full blocks shared (a reference each), the partial last
        one copied into a fresh block, because the child writes into it next. Returns the
        (source, destination) block ids to copy, None if there is nothing to copy, False
        (changing nothing) if there is no free block for the copy."""
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.free_blocks:
            return False
        for block_id in parent.block_table[:full]:
            self._ref(block_id)
        child.block_table = parent.block_table[:full]
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        child.num_computed_tokens = num_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        if not partial:
            return None
        self._append_fresh(child, 1)
        return parent.block_table[full], child.block_table[-1]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash != NO_HASH:
                continue  # a prefix-cache hit: already registered
            h = self.block_hash_at(seq, i)
            if h not in self.cached:  # a twin computed by another seq keeps the slot
                parent = seq.block_hashes[i - 1] if i else seq.hash_root
                block.block_hash, block.parent_hash, block.root_hash = h, parent, seq.hash_root
                block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                self.cached[h] = block.block_id
                self.events.stored.append((h, None if i == 0 else parent))
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks go to the LRU end first, so they are evicted before
        the shared prefix blocks that more requests are likely to reuse."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def release_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's blocks past the ones that hold its first num_tokens tokens (the slots of
        speculative tokens that were rejected)."""
        keep = max(-(-num_tokens // self.block_size), seq.num_registered_blocks)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
    def drop_chain(self, root_hash: int) -> None:
        """Evict the cached free blocks of one chain now (an unloaded LoRA adapter's)."""
        for block_id in list(self.free_blocks):
            block = self.blocks[block_id]
            if block.block_hash != NO_HASH and block.root_hash == root_hash:
                self._uncache(block)
                self.free_blocks.move_to_end(block_id, last=False)

    def drain_events(self) -> KvEvents:
        events, self.events = self.events, KvEvents()
        return events

    # ---- internals --------------------------------------------------------------------------
    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.block_hash == NO_HASH:
                self.free_blocks.move_to_end(block_id, last=False)  # uncached: reuse first

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _append_fresh(self, seq: Sequence, n: int) -> None:
        for _ in range(n):
            block_id, _ = self.free_blocks.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            if block.block_hash != NO_HASH:
                self._uncache(block)
            block.ref_count = 1
            seq.block_table.append(block_id)

    def _uncache(self, block: Block) -> None:
        del self.cached[block.block_hash]
        self.events.removed.append(block.block_hash)
        block.block_hash, block.parent_hash, block.token_ids, block.root_hash = NO_HASH, NO_HASH, (), ROOT_HASH
