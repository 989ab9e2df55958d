"""A resumed stream (protocol.Resume) carries the request's original max_tokens and how many
tokens are done (Resume.generated): the engine counts those against max_tokens, and checks the
original prompt plus max_tokens against its context, not the prompt with the delivered tokens
appended plus max_tokens. A real engine worker with a small context (--max-model-len 64) on a
real NATS."""

import pytest

from shared import protocol
from shared.bus import Bus
from shared.store import connect_redis
from tests.helpers import new_request, start_worker, stream_request, wait_registered

MAX_MODEL_LEN = 64
PROMPT = list(range(10, 50))  # 40 tokens: 40 + 24 fills the context exactly


@pytest.fixture(scope="module")
async def worker(infra, tiny_model_dir, tmp_path_factory):
    redis = connect_redis(infra.redis_url)
    w = start_worker(infra, tiny_model_dir, tmp_path_factory.mktemp("w-resume"), None, "--num-kv-blocks", "128",
                     "--max-model-len", str(MAX_MODEL_LEN), deployment="resume-limits")
    try:
        await wait_registered(redis, w)
        yield w
    finally:
        w.kill9()
        await redis.aclose()


@pytest.fixture
async def bus(infra):
    b = await Bus.connect(infra.nats_url, "test-resume-limits")
    yield b
    await b.close()


def request(prompt: list[int], max_tokens: int, generated: int = 0) -> protocol.GenerateRequest:
    req = new_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req.model = "resume-limits"
    if generated:
        req.resume = protocol.Resume(request_id="the-first-leg", generated=generated)
    return req


async def test_a_resumed_stream_finishes_its_original_max_tokens_within_the_context(bus, worker):
    subject = protocol.engine_generate(worker.replica_id)
    whole = await stream_request(bus, subject, request(PROMPT, 24))
    tokens = [t for c in whole for t in c.token_ids]
    assert whole[-1].finish_reason == "length" and len(tokens) == 24, whole[-1]
    # The first leg delivered 10 tokens: the prompt with them appended (50) plus max_tokens (24)
    # exceeds 64, but the request (40 + 24) does not.
    rest = await stream_request(bus, subject, request(PROMPT + tokens[:10], 24, generated=10))
    assert rest[-1].error is None and rest[-1].finish_reason == "length", rest[-1]
    assert [t for c in rest for t in c.token_ids] == tokens[10:]
    assert rest[-1].usage.completion_tokens == 24  # the whole stream's, as the uninterrupted run's


async def test_a_resumed_stream_with_nothing_left_is_refused(bus, worker):
    subject = protocol.engine_generate(worker.replica_id)
    chunks = await stream_request(bus, subject, request(PROMPT + list(range(12)), 12, generated=12))
    assert chunks[-1].error is not None and chunks[-1].error.code == protocol.ErrorCode.BAD_REQUEST, chunks[-1]
    assert "max_tokens" in chunks[-1].error.message
    after = await stream_request(bus, subject, request(PROMPT, 2))  # and it serves on
    assert after[-1].finish_reason == "length"
