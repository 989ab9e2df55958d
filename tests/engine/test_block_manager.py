"""Block manager and scheduler logic, without a model."""

import subprocess
import sys

from services.engine.block_manager import BlockManager
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from shared.block_hash import hash_block, prompt_block_hashes

BS = 4


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def compute(bm: BlockManager, s: Sequence) -> None:
    """Pretend the model ran over everything allocated."""
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_block_hashes_are_identical_in_another_process():
    tokens = list(range(100, 137))
    code = ("from shared.block_hash import prompt_block_hashes;"
            f"print(prompt_block_hashes({tokens}, 16))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".").stdout
    assert out.strip() == str(prompt_block_hashes(tokens, 16))
    assert len(prompt_block_hashes(tokens, 16)) == 2  # the partial last block has no hash
    assert hash_block(0, [1, 2]) != hash_block(1, [1, 2])  # the chain matters


def test_prefix_reuse_refcounts_and_events():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = seq("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert bm.admit(a, 10, bm.match_prefix(a))
    compute(bm, a)
    events = bm.drain_events()
    assert [h for h, _ in events.stored] == prompt_block_hashes(a.token_ids, BS)
    assert events.stored[0][1] is None and events.stored[1][1] == events.stored[0][0]

    b = seq("b", list(range(8)) + [99, 98, 97])  # shares a's two full blocks
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.admit(b, b.num_tokens - 8, hits)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 10 + 11

    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10 and all(blk.ref_count == 0 for blk in bm.blocks)
    assert len(bm.cached) == 2  # still cached, evictable


def test_whole_prompt_cached_still_computes_the_last_token():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = seq("a", list(range(8)))
    bm.admit(a, 8, [])
    compute(bm, a)
    bm.free(a)
    again = seq("again", list(range(8)))
    assert len(bm.match_prefix(again)) == 1  # block 2 holds the last token: recomputed


def test_lru_eviction_removes_the_oldest_cached_blocks_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = seq("old", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.admit(old, 9, [])
    compute(bm, old)
    bm.free(old)
    bm.drain_events()
    new = seq("new", [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62])  # needs all 4 blocks
    assert bm.admit(new, new.num_tokens, bm.match_prefix(new))
    removed = bm.drain_events().removed
    # The tail block of "old" goes before its first block.
    assert removed == list(reversed(prompt_block_hashes(old.token_ids, BS)))
    assert not bm.cached


def test_admission_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    big = seq("big", list(range(20)))
    assert not bm.admit(big, 20, [])
    assert bm.num_free_blocks == 3 and big.block_table == []


def test_scheduler_chunks_prefill_without_stalling_decodes():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    short = seq("short", [1, 2, 3])
    sched.add(short)
    batch = sched.schedule()
    assert batch.num_new_tokens == [3]
    compute(bm, short)
    short.token_ids.append(7)  # it sampled a token: now it decodes

    long = seq("long", list(range(100, 140)))
    sched.add(long)
    for chunk in (15, 15, 10):
        batch = sched.schedule()
        assert batch.seqs[0] is short and batch.num_new_tokens[0] == 1  # the decode runs every step
        assert batch.seqs[1] is long and batch.num_new_tokens[1] == chunk  # the prompt, in chunks
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            bm.cache_full_blocks(s)
        short.token_ids.append(7)
    assert long.num_computed_tokens == 40


def test_scheduler_preempts_the_newest_and_readmits_it_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0)
    first, second = seq("first", [1, 2, 3, 4, 5, 6, 7]), seq("second", [11, 12, 13, 14, 15, 16, 17])
    sched.add(first)
    sched.add(second)
    sched.schedule()
    assert bm.num_free_blocks == 0
    for s in (first, second):
        s.num_computed_tokens = s.num_tokens
        s.token_ids.extend([9, 9])  # both grew past their second block
    batch = sched.schedule()
    assert batch.preempted == [second] and batch.seqs == [first]
    assert sched.waiting[0] is second and second.block_table == [] and second.num_computed_tokens == 0
    assert second.num_cached_tokens == 0  # recomputation is not counted as a cache hit
    sched.finish(first, "stop")
    sched.finish(second, "abort")
    assert bm.num_free_blocks == 4
