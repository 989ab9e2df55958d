"""Speculative decoding through the whole stack: an engine started with --speculative-config (n-gram)
on the tiny shape rebuilt to copy its prompt; the response's `strata` object (and the final
streamed chunk's) reports the request's acceptance, and the engine's /metrics count the drafts
with vLLM's names."""

import json

import aiohttp
import pytest

from shared import keys
from shared.copying_model import make_copying_model
from shared.localstack import LocalStack
from shared.store import connect_redis

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "adaptive": False}


@pytest.fixture(scope="module")
def spec_stack(tiny_model_dir, tmp_path_factory):
    """Its own NATS and Valkey: its scheduler must not take the other stacks' requests."""
    model = make_copying_model(tiny_model_dir, tmp_path_factory.mktemp("spec-model") / "tiny-copying")
    s = LocalStack(str(model), engines=1,
                   engine_args=["--num-kv-blocks", "256", "--threads", "1", "--speculative-config", json.dumps(SPEC)],
                   log_dir=tmp_path_factory.mktemp("spec-stack-logs"))
    s.start()
    yield s
    s.stop()


def copy_prompt() -> str:
    text = open("shared/data/corpus.txt", encoding="utf-8").read()[:400]
    return text + "\n\n" + text[:30]


async def post(http, stack, body: dict):
    return await http.post(stack.base_url + "/v1/completions", json={"model": stack.deployment, **body},
                           headers={"Authorization": f"Bearer {stack.api_key}"})


async def test_the_strata_object_reports_the_acceptance_rate(spec_stack):
    body = {"prompt": copy_prompt(), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with await post(http, spec_stack, body) as resp:
            assert resp.status == 200, await resp.text()
            whole = await resp.json()
        async with await post(http, spec_stack, {**body, "stream": True}) as resp:
            events = [json.loads(line[6:]) async for line in resp.content
                      if line.startswith(b"data: {")]
    spec = whole["strata"]["spec_decode"]
    assert spec["draft_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == round(spec["accepted_tokens"] / spec["draft_tokens"], 4)
    streamed = [e["strata"] for e in events if "strata" in e]
    assert len(streamed) == 1 and streamed[0]["spec_decode"] == spec  # the same request: the same drafts
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == whole["choices"][0]["text"]

    redis = connect_redis(spec_stack.infra.redis_url)
    url = (await redis.hget(keys.replica("engine-0"), "http_url")).decode()
    await redis.aclose()
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()

    def metric(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert metric("strata:spec_decode_num_draft_tokens_total") == 2 * spec["draft_tokens"]
    assert metric("strata:spec_decode_num_accepted_tokens_total") == 2 * spec["accepted_tokens"]
    assert metric("strata:spec_decode_num_drafts_total") >= 2
    assert metric("strata:spec_decode_num_accepted_tokens_per_pos_total") == 2 * spec["accepted_tokens"]
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total"):
        assert metric("vllm:" + name) == metric("strata:" + name)  # vLLM's own names as well
