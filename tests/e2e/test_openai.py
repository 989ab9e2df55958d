"""The OpenAI-compatible API end to end, with the official `openai` client and aiohttp."""

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from services.engine import LLM, SamplingParams
from shared import keys
from shared.store import connect_redis

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)


@pytest.fixture(scope="module")
def aclient(stack):
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)


def test_models_are_listed(client):
    assert {m.id for m in client.models.list().data} == {"tiny-llama", "tiny-spare"}


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


async def test_chat_streaming_async_with_usage(aclient):
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, usage, n = "", None, None, 0
    async for chunk in stream:
        n += 1
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert n > 3 and finish == "length" and usage.completion_tokens == 20
    # the same request without streaming gives the same text
    again = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == text


def test_text_completion_streaming_sync(client):
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].text and len(pieces) > 2


def test_greedy_text_equals_the_offline_engine(client, tiny_model_dir):
    prompts = ["The queue holds", "Größe und Straße sind", "def main():\n    "]
    llm = LLM(tiny_model_dir, num_kv_blocks=256)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, ref in zip(prompts, offline):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.outputs[0].text


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "A long shared system prompt about queues and tasks. " * 12
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16 and cached % 16 == 0


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="Tell me about", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:13]
    r = client.completions.create(model=MODEL, prompt="Tell me about", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Random words:", max_tokens=24, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


# ---- errors ------------------------------------------------------------------------------------
async def post(stack, path, body, key="default", raw=None, headers=None):
    key = stack.api_key if key == "default" else key
    hdrs = {"Authorization": f"Bearer {key}"} if key else {}
    hdrs.update(headers or {})
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + path, json=None if raw is not None else body,
                             data=raw, headers=hdrs) as resp:
            return resp.status, resp.headers.copy(), await resp.json(content_type=None)


def assert_openai_error(body, code=None):
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": "x", "temperature": 5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 999999]}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": "x", "n": 17}, "n"),  # above the gateway's --max-n (16)
    ({"model": MODEL, "prompt": "x", "stop": 5}, "stop"),
    ({"model": MODEL, "prompt": "x", "top_k": 9223372036854775808}, "top_k"),  # once killed an engine
    ({"model": MODEL, "prompt": "x", "seed": 10**30}, "seed"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids"),
])
async def test_400_bad_parameters(stack, body, param):
    status, _, err = await post(stack, "/v1/completions", body)
    assert status == 400
    assert_openai_error(err)
    assert err["error"]["param"] == param


async def test_400_malformed_json_and_chat_messages(stack):
    status, _, err = await post(stack, "/v1/chat/completions", None, raw=b"{not json")
    assert status == 400
    assert_openai_error(err)
    status, _, err = await post(stack, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "pirate"}]})
    assert status == 400 and err["error"]["param"] == "messages"
    status, _, err = await post(stack, "/v1/completions", None, raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400  # nesting deep enough to overflow the parser's recursion
    assert_openai_error(err)


async def test_401_missing_or_bad_key(stack):
    status, _, err = await post(stack, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert status == 401
    assert_openai_error(err, "invalid_api_key")
    status, _, err = await post(stack, "/v1/completions", {"model": MODEL, "prompt": "x"}, key="sk-strata-nope")
    assert status == 401


async def test_404_unknown_model(stack):
    status, _, err = await post(stack, "/v1/chat/completions",
                                {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404
    assert_openai_error(err, "model_not_found")


async def test_400_prompt_too_long(stack):
    status, _, err = await post(stack, "/v1/completions", {"model": MODEL, "prompt": "word " * 3000})
    assert status == 400
    assert_openai_error(err, "context_length_exceeded")
    assert "maximum context length is 2048" in err["error"]["message"]


async def test_413_body_too_large(stack):
    status, _, err = await post(stack, "/v1/completions", None, raw=b'{"model": "x", "prompt": "' + b"a" * 5_000_000 + b'"}')
    assert status == 413
    assert_openai_error(err)


async def test_429_rate_limited_with_retry_after(stack):
    from services.gateway.auth import create_key
    redis = connect_redis(stack.infra.redis_url)
    limited = await create_key(redis, "limited-tenant", rpm=2)
    await redis.aclose()
    statuses = []
    for _ in range(3):
        status, headers, body = await post(stack, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                                           key=limited)
        statuses.append(status)
    assert statuses == [200, 200, 429]
    assert_openai_error(body, "rate_limit_exceeded")
    assert 1 <= int(headers["retry-after"]) <= 60


async def test_503_no_replica_with_retry_after(stack):
    status, headers, err = await post(stack, "/v1/completions", {"model": "tiny-spare", "prompt": "x"})
    assert status == 503
    assert_openai_error(err, "overloaded")
    assert int(headers["retry-after"]) >= 1


async def test_error_after_the_first_byte_is_in_band(stack, client):
    # The deadline passes mid-stream: the status was already 200, so the error comes as an event.
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/v1/completions",
                             json={"model": MODEL, "prompt": "Go on", "max_tokens": 1900, "stream": True,
                                   "ignore_eos": True},
                             headers={"Authorization": f"Bearer {stack.api_key}", "Strata-Timeout": "0.4"}) as resp:
            assert resp.status == 200
            events = [line[6:] async for line in resp.content if line.startswith(b"data: ")]
    assert len(events) > 1
    last = json.loads(events[-1])
    assert_openai_error(last, "deadline_exceeded")
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model=MODEL, prompt="Go on", max_tokens=1900, stream=True,
                                           extra_body={"ignore_eos": True},
                                           extra_headers={"Strata-Timeout": "0.4"}):
            pass
    # and the stack keeps serving
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


async def engine_metric(stack, name: str) -> float:
    redis = connect_redis(stack.infra.redis_url)
    url = (await redis.hget(keys.replica("engine-0"), "http_url")).decode()
    await redis.aclose()
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_client_disconnect_frees_engine_blocks_within_a_second(stack):
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/v1/completions",
                             json={"model": MODEL, "prompt": "Keep going " * 20, "max_tokens": 1500, "stream": True,
                                   "ignore_eos": True},
                             headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
            seen = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    seen += 1
                if seen >= 5:
                    break
            assert await engine_metric(stack, "strata:num_requests_running") == 1
            resp.connection.transport.abort()  # the client vanishes mid-stream
    left = time.monotonic()
    while await engine_metric(stack, "strata:kv_cache_usage_perc") > 0:
        assert time.monotonic() - left < 1.0, "blocks not freed within a second"
        await asyncio.sleep(0.05)
    assert await engine_metric(stack, "strata:num_requests_running") == 0


async def test_health_metrics_and_openapi(stack):
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.base_url + "/health") as resp:
            assert resp.status == 200
        async with http.get(stack.base_url + "/metrics") as resp:
            assert "strata:gateway_requests_total" in await resp.text()
        async with http.get(stack.base_url + "/openapi.json",
                            headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
            spec = await resp.json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    async with aiohttp.ClientSession() as http:
        for i in range(5):  # unknown paths: 404 in OpenAI's shape, one metric label for all of them
            async with http.get(f"{stack.base_url}/nope/{i}") as resp:
                assert resp.status == 404 and "error" in await resp.json()
        async with http.get(stack.base_url + "/metrics") as resp:
            text = await resp.text()
    assert 'endpoint="unmatched"' in text and "/nope/" not in text


def test_layer_timings_add_up_to_the_end_to_end_latency(client):
    r = client.completions.with_raw_response.create(model=MODEL, prompt="Timing " * 30, max_tokens=40,
                                                    temperature=0, extra_body={"ignore_eos": True})
    body = json.loads(r.text)
    timings = body["strata"]["timings"]
    assert json.loads(r.headers["x-strata-timings"]) == timings
    assert body["strata"]["replica_id"] == "engine-0"
    parts = sum(v for k, v in timings.items() if k != "e2e")
    # Every stretch of the request is in one layer; what is left is the gateway's response
    # writing and scheduling gaps between hops (stated tolerance: 5 ms or 10%).
    assert abs(timings["e2e"] - parts) <= max(0.005, 0.1 * timings["e2e"]), timings
    assert timings["engine_decode"] > 0 and timings["engine_prefill"] > 0


async def test_token_limits_charge_what_was_used(stack):
    from services.gateway.auth import create_key, hash_key
    redis = connect_redis(stack.infra.redis_url)
    key = await create_key(redis, "tpm-tenant", tpm=100_000)
    window = int(time.time() // 60)
    status, _, body = await post(stack, "/v1/chat/completions",
                                 {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
                                  "stop_token_ids": list(range(200, 4000))}, key=key)  # stops early
    assert status == 200
    if int(time.time() // 60) != window:
        pytest.skip("crossed a minute boundary: the estimate stays in the old window by design")
    used = body["usage"]["total_tokens"]
    assert used < 200
    counter = keys.rate_counter(hash_key(key), "tokens", window)
    deadline = time.monotonic() + 2
    while int(await redis.get(counter) or 0) != used and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert int(await redis.get(counter)) == used  # not prompt + 1500
    await redis.aclose()
