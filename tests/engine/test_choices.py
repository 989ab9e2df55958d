"""n > 1 in the engine: choices forked from one sequence after its prefill (services.engine.choices)."""

import random

import pytest

from services.engine.async_engine import AsyncLLMEngine
from services.engine.block_manager import BlockManager
from services.engine.choices import seed_for_choice
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.config import EngineArgs
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.engine.sequence import Sequence
from tests.engine.conftest import assert_no_leak


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_num_seqs=16, num_kv_blocks=256)


def test_fork_shares_the_prompts_full_blocks_and_copies_the_partial_one(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, EngineArgs.from_kwargs(num_kv_blocks=64), streaming=True)
    engine.add_request("r", prompt(40), SamplingParams(max_tokens=4, temperature=0, n=3))
    engine.step()  # the prefill of choice 0, then the fork
    first, *others = engine.requests["r"].group.seqs
    bm = engine.block_manager
    # 40 tokens: blocks 0-1 full and shared; block 2 holds 24..39 and is copied per choice.
    for seq in others:
        assert seq.block_table[:2] == first.block_table[:2]
        assert seq.block_table[2] != first.block_table[2]
        assert seq.num_computed_tokens == 39  # the prompt's last position is recomputed into its copy
    assert [bm.blocks[b].ref_count for b in first.block_table[:2]] == [3, 3]
    assert len({seq.block_table[2] for seq in [first, *others]}) == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)


@pytest.mark.parametrize("prompt_len", [1, 17, 33, 40])  # no copy at 1, 17 and 33; a partial block at 40
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_choices_equal_the_single_completion(tiny_model_dir, prompt_len, prefix_caching):
    llm = LLM(tiny_model_dir, num_kv_blocks=64, enable_prefix_caching=prefix_caching)
    ids = prompt(prompt_len, prompt_len)
    single = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    forked = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=3))[0]
    assert [c.index for c in forked.outputs] == [0, 1, 2]
    assert all(c.token_ids == single.outputs[0].token_ids for c in forked.outputs)
    assert_no_leak(llm.engine)


def test_seeded_choices_are_reproducible_and_differ(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42, n=3, ignore_eos=True)
    ids = prompt(30)
    first, again = llm.generate(ids, params)[0], llm.generate(ids, params)[0]
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in again.outputs]
    assert len({tuple(t) for t in tokens}) == 3
    # Choice 0 is the n=1 request; choice i draws as a request seeded with the choice's seed.
    alone = llm.generate([ids, ids], [SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True),
                                      SamplingParams(max_tokens=16, temperature=1.0, seed=seed_for_choice(42, 2),
                                                     ignore_eos=True)])
    assert alone[0].outputs[0].token_ids == tokens[0] and alone[1].outputs[0].token_ids == tokens[2]
    assert_no_leak(llm.engine)


def test_each_choice_has_its_own_finish_reason(llm):
    ids = prompt(20, 3)
    out = llm.generate(ids, SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=4, stop_token_ids=[]))[0]
    assert len(out.outputs) == 4 and all(c.finish_reason in ("stop", "length") for c in out.outputs)
    many = llm.generate(prompt(5, 9), SamplingParams(max_tokens=3, temperature=1.0, seed=8, n=16))[0]
    assert [c.index for c in many.outputs] == list(range(16))
    assert_no_leak(llm.engine)


def test_streaming_outputs_end_each_choice_once_and_the_request_last(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, EngineArgs.from_kwargs(num_kv_blocks=64), streaming=True)
    engine.add_request("r", prompt(25), SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3, ignore_eos=True))
    ended, tokens, final = [], {0: [], 1: [], 2: []}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert final is None  # nothing after the request's final output
            c = out.outputs[0]
            tokens[c.index] += out.new_token_ids
            if c.finish_reason is not None:
                ended.append(c.index)
                assert out.choices_running == 3 - len(ended)
            if out.finished:
                final = out
    assert sorted(ended) == [0, 1, 2] and final.choices_running == 0
    assert final.num_completion_tokens == 15 and all(len(t) == 5 for t in tokens.values())
    assert_no_leak(engine)


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])  # before the fork, right after it, mid-decode
def test_abort_ends_every_choice_once_and_frees_every_block(tiny_model_dir, steps_before_abort):
    engine = LLMEngine(tiny_model_dir, EngineArgs.from_kwargs(num_kv_blocks=64), streaming=True)
    engine.add_request("r", prompt(40), SamplingParams(max_tokens=50, temperature=1.0, n=4, ignore_eos=True))
    for _ in range(steps_before_abort):
        engine.step()
    assert engine.abort_request("r")
    outs = engine.step()
    assert sorted(o.outputs[0].index for o in outs) == [0, 1, 2, 3]
    assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert [o.finished for o in outs] == [False, False, False, True]
    assert_no_leak(engine)


def test_choices_survive_preemption_and_blocks_run_out(tiny_model_dir):
    """Too few blocks for every choice at once: choices are preempted and recomputed, or prefill
    anew when no block is left for the fork's copy; the output is what it would be otherwise."""
    ids = prompt(40, 5)
    roomy = LLM(tiny_model_dir, num_kv_blocks=64).generate(ids, SamplingParams(max_tokens=40, temperature=0,
                                                                                ignore_eos=True))[0]
    tight = LLM(tiny_model_dir, num_kv_blocks=9)
    out = tight.generate(ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=4))[0]
    assert all(c.token_ids == roomy.outputs[0].token_ids for c in out.outputs)
    assert tight.stats()["num_preemptions"] > 0
    assert_no_leak(tight.engine)


def test_block_manager_fork_without_a_free_block_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent, child = (Sequence(r, list(range(7)), SamplingParams()) for r in ("p", "c"))
    assert bm.admit(parent, 7, [])
    parent.num_computed_tokens = 7
    assert bm.fork(parent, child, 6) is False  # 6 tokens: 1 full block shared, 2 to copy: no block free
    assert child.block_table == [] and [b.ref_count for b in bm.blocks] == [1, 1]
    assert bm.fork(parent, child, 4) is None  # exactly one full block: shared, nothing to copy
    assert child.block_table == parent.block_table[:1] and bm.blocks[parent.block_table[0]].ref_count == 2
    bm.free(child)
    bm.free(parent)
    assert bm.num_free_blocks == 2


def test_bad_n_is_refused(llm):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("x", SamplingParams(n=0))
    assert err.value.param == "n"
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_processed("resumed", None, [1, 2, 3, 4], SamplingParams(n=2).resolved(), resumed=(2, 0))
    assert err.value.param == "n"
    assert_no_leak(llm.engine)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("x", SamplingParams(n=SamplingParams.MAX_N + 1))
    assert err.value.param == "n"


async def test_async_engine_refuses_a_resumed_n_at_add_time_and_serves_on(tiny_model_dir):
    engine = AsyncLLMEngine.from_model(tiny_model_dir, num_kv_blocks=32)
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError):
            engine.add_request("resumed", [1, 2, 3, 4], SamplingParams(n=2), resumed=(2, 0))
        stream = engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, n=2))
        outs = [out async for out in stream]
        assert outs[-1].finished and sorted(o.outputs[0].index for o in outs if o.outputs[0].finish_reason) == [0, 1]
    finally:
        await engine.shutdown()
    assert_no_leak(engine.engine)
