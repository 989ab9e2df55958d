"""The async interface: streams step by step off the event loop, aborts free blocks at once. Each
behaviour test runs on both clients: the step loop in a thread (AsyncLLMEngine) and in an engine
core process of its own (CoreClient)."""

import asyncio
import os
import signal
import socket
import time

import pytest

from services.engine import InvalidRequestError, LLM, SamplingParams
from services.engine.async_engine import AsyncLLMEngine
from services.engine.core_client import CoreClient
from tests.engine.conftest import assert_no_leak

CLIENTS = {"thread": AsyncLLMEngine, "process": CoreClient}


@pytest.fixture(params=list(CLIENTS))
async def engine(request, tiny_model_dir):
    eng = CLIENTS[request.param].from_model(tiny_model_dir, num_kv_blocks=256, max_num_seqs=8)
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest.fixture
async def thread_engine(tiny_model_dir):
    eng = AsyncLLMEngine.from_model(tiny_model_dir, num_kv_blocks=256, max_num_seqs=8)
    await eng.start()
    yield eng
    await eng.shutdown()


def assert_idle(engine) -> None:
    """Nothing runs and every block is free: checked on the engine itself in this process, and
    on the figures the core sent with its last step otherwise."""
    if isinstance(engine, AsyncLLMEngine):
        return assert_no_leak(engine.engine)
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["used_blocks"] == 0, stats
    assert stats["free_blocks"] == stats["total_blocks"] and engine.num_open_streams == 0


async def collect(stream):
    outs = []
    async for out in stream:
        outs.append(out)
    return outs


async def test_streams_match_the_offline_api(engine, tiny_model_dir):
    prompts = ["The queue holds", "Größe und Straße", "import os\n"]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    streams = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
    offline = LLM(tiny_model_dir, num_kv_blocks=256).generate(prompts, params)
    for outs, ref in zip(results, offline):
        assert [t for o in outs for t in o.new_token_ids] == ref.outputs[0].token_ids
        assert "".join(o.text_delta for o in outs) == ref.outputs[0].text
        assert outs[-1].finished and sum(o.finished for o in outs) == 1  # exactly one final output
        assert len(outs) > 1  # streamed step by step, not all at once
    assert_idle(engine)


async def test_stop_strings_end_streams_where_the_offline_api_does_and_free_their_blocks(engine, tiny_model_dir):
    """Stop strings are checked where the text is made (the worker, beside a core process): the
    choice ends at the token that completes one, its text cut there, exactly once, whatever the
    core ran on; and the core frees the sequence."""
    llm = LLM(tiny_model_dir, num_kv_blocks=256)
    prompt = "The queue holds"
    free_text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stop = free_text[12:16]  # met mid-stream, before max_tokens
    assert stop.strip() and stop in free_text
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
              SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=40, ignore_eos=True, stop=[" ", "e"])]
    offline = llm.generate([prompt] * len(params), params)
    streams = [engine.add_request(f"s{i}", prompt, sp) for i, sp in enumerate(params)]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
    assert offline[0].outputs[0].text == free_text[:free_text.index(stop)]
    assert offline[1].outputs[0].text == free_text[:free_text.index(stop) + len(stop)]
    for outs, ref in zip(results, offline):
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        for choice in ref.outputs:
            mine = [o for o in outs if o.outputs[0].index == choice.index]
            assert [t for o in mine for t in o.new_token_ids] == choice.token_ids
            assert "".join(o.text_delta for o in mine) == choice.text
            assert mine[-1].outputs[0].finish_reason == choice.finish_reason == "stop"
            assert mine[-1].outputs[0].text == choice.text
        assert outs[-1].num_completion_tokens == ref.num_completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    await asyncio.sleep(0.2)  # the core applies the stops
    assert_idle(engine)
    # The text is made off the step loop beside a core process, and on it in-process.
    assert (engine.stats()["step_detokenize_s"] == 0.0) == isinstance(engine, CoreClient)


async def test_abort_mid_stream_frees_blocks_and_spares_the_others(engine):
    long = engine.add_request("long", "A long story " * 20, SamplingParams(max_tokens=400, ignore_eos=True))
    other = engine.add_request("other", "Short one", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    seen = 0
    async for out in long:
        seen += len(out.new_token_ids)
        if seen >= 5 and not out.finished:
            engine.abort("long")
            break
    rest = await asyncio.wait_for(collect(long), 10)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    other_outs = await asyncio.wait_for(collect(other), 30)
    assert other_outs[-1].outputs[0].finish_reason == "length" and len(other_outs[-1].outputs[0].token_ids) == 30
    await asyncio.sleep(0.1)
    assert_idle(engine)


async def test_invalid_request_raises_at_add_time_and_engine_keeps_serving(engine):
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", "", SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad2", "hi", SamplingParams(top_p=2.0))
    outs = await asyncio.wait_for(collect(engine.add_request("ok", "hi", SamplingParams(max_tokens=3, ignore_eos=True))), 30)
    assert len(outs[-1].outputs[0].token_ids) == 3


async def test_event_loop_stays_responsive_during_steps(engine):
    stream = engine.add_request("busy", "x " * 300, SamplingParams(max_tokens=64, ignore_eos=True))
    ticks = 0
    consumer = asyncio.create_task(collect(stream))
    while not consumer.done():
        await asyncio.sleep(0.005)
        ticks += 1
    assert ticks > 5  # the loop kept running while the engine thread computed


async def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(thread_engine):
    engine = thread_engine
    from services.engine.async_engine import StepFailedError

    runner = engine.engine.runner
    real = runner.execute
    calls = []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    runner.execute = broken_once
    try:
        with pytest.raises(StepFailedError):
            await asyncio.wait_for(collect(engine.add_request("doomed", "x y z", SamplingParams(max_tokens=5))), 30)
        outs = await asyncio.wait_for(collect(engine.add_request("after", "hello", SamplingParams(
            max_tokens=4, ignore_eos=True))), 30)
        assert len(outs[-1].outputs[0].token_ids) == 4 and engine.error is None
    finally:
        runner.execute = real
    assert_no_leak(engine.engine)


async def test_a_snapshot_covers_exactly_the_kv_event_batches_up_to_its_seq(engine):
    batches: list[tuple[int, object]] = []
    engine.on_kv_events = lambda seq, events: batches.append((seq, events))
    await asyncio.wait_for(collect(engine.add_request("a", "The cache holds blocks " * 8,
                                                      SamplingParams(max_tokens=8, ignore_eos=True))), 30)
    seq, hashes = await engine.kv_snapshot()
    assert hashes and batches and batches[-1][0] == seq  # its batches arrived before it returned
    assert [s for s, _ in batches] == list(range(1, seq + 1))  # numbered once each, in order
    cached: set[int] = set()
    for _, events in batches:
        cached |= {h for h, _ in events.stored}
        cached -= set(events.removed)
    assert cached == hashes


async def test_a_killed_core_fails_its_streams_at_once_and_refuses_new_requests(tiny_model_dir):
    from services.engine.engine_client import EngineDeadError

    engine = CoreClient.from_model(tiny_model_dir, num_kv_blocks=256, max_num_seqs=8)
    await engine.start()
    try:
        stream = engine.add_request("doomed", "A long story " * 10, SamplingParams(max_tokens=2000, ignore_eos=True))
        await asyncio.wait_for(stream.__anext__(), 30)  # it runs
        os.kill(engine.core_pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError, match="signal 9"):
            await asyncio.wait_for(collect(stream), 5)
        await asyncio.wait_for(engine.failed.wait(), 1)
        assert time.monotonic() - killed < 1.0 and engine.num_open_streams == 0
        with pytest.raises(EngineDeadError):
            engine.add_request("late", "hello", SamplingParams(max_tokens=2))
    finally:
        await engine.shutdown()


async def test_a_core_exits_when_its_worker_is_gone(tiny_model_dir):
    """A worker killed outright leaves no core behind: the core's end of the socket closes."""
    engine = CoreClient.from_model(tiny_model_dir, num_kv_blocks=64)
    await engine.start()
    stream = engine.add_request("orphaned", "A long story " * 10, SamplingParams(max_tokens=2000, ignore_eos=True))
    await asyncio.wait_for(stream.__anext__(), 30)
    # What the kernel does to the socket of a worker that died: the core reads its end.
    socket.socket(fileno=os.dup(engine._conn.fileno())).shutdown(socket.SHUT_RDWR)
    assert await asyncio.get_running_loop().run_in_executor(None, engine.process.wait, 10) == 1
    await engine.shutdown()
