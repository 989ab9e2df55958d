"""LoRA adapters through the whole stack: loaded and unloaded over HTTP with an admin key (and
refused without one), served as model names with the transformers + peft tokens, listed in
/v1/models with their parent, each with its own prefix cache; a bad adapter changes nothing."""

from __future__ import annotations

import json

import aiohttp
import pytest
import torch

from services.gateway.auth import create_key
from shared.localstack import LocalStack
from shared.store import connect_redis

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lora_stack(tiny_model_dir, tmp_path_factory):
    # Its own NATS and Valkey: its scheduler must not join other stacks' queue group.
    s = LocalStack(str(tiny_model_dir), engines=2, deployment="tiny",
                   engine_args=["--threads", "1", "--num-kv-blocks", "256", "--enable-lora", "--max-loras", "2",
                                "--max-lora-rank", "8", "--max-model-len", "1024"],
                   log_dir=tmp_path_factory.mktemp("lora-stack-logs"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prompt(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    return torch.randint(8, vocab, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def peft_greedy(model_dir, adapter_dir, prompt) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model = (base if adapter_dir is None else PeftModel.from_pretrained(base, str(adapter_dir))).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


async def complete(http, stack, model: str, prompt: list[int]) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with http.post(stack.base_url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {stack.api_key}"}) as resp:
        return resp.status, await resp.json()


def text_of(body: dict) -> str:
    return body["choices"][0]["text"]


async def test_load_serve_unload_over_http(lora_stack, tiny_model_dir, peft_adapters, prompt, tmp_path):
    stack = lora_stack
    redis = connect_redis(stack.infra.redis_url)
    user_key = await create_key(redis, "lora-user")
    await redis.aclose()
    admin = {"Authorization": f"Bearer {stack.api_key}"}
    url = stack.base_url

    async with aiohttp.ClientSession() as http:
        async def post(path, body, headers):
            async with http.post(url + path, json=body, headers=headers) as resp:
                return resp.status, await resp.text()

        load = {"lora_name": "attn", "lora_path": str(peft_adapters["attn-r8"])}
        assert (await post("/v1/load_lora_adapter", load, {}))[0] == 401
        status, text = await post("/v1/load_lora_adapter", load, {"Authorization": f"Bearer {user_key}"})
        assert status == 403 and "admin key" in text
        # Bad adapters: the reason comes back, and nothing is registered.
        for bad, reason in ((peft_adapters["all-r16"], "rank 16 is above this engine's max_lora_rank 8"),
                            (tmp_path / "missing", "does not exist")):
            status, text = await post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)}, admin)
            assert status == 400 and reason in json.loads(text)["error"]["message"]
        # A field the route does not honour is refused by name, not ignored (vLLM's load_inplace).
        status, text = await post("/v1/load_lora_adapter", {**load, "load_inplace": True}, admin)
        assert status == 400 and json.loads(text)["error"]["param"] == "load_inplace", text
        status, text = await post("/v1/load_lora_adapter", load, admin)
        assert status == 200, text
        assert (await post("/v1/load_lora_adapter", {**load, "lora_path": str(peft_adapters["qv-rs"])}, admin))[0] == 409
        assert (await post("/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(peft_adapters["mlp-r4"])},
                           admin))[0] == 200

        async with http.get(url + "/v1/models", headers=admin) as resp:
            models = {m["id"]: m for m in (await resp.json())["data"]}
        assert models["attn"]["parent"] == "tiny" and models["mlp"]["parent"] == "tiny" and "bad" not in models
        # An adapter's context is its base's, as the replicas advertise it (not config.json's 2048).
        assert models["attn"]["max_model_len"] == models["mlp"]["max_model_len"] == models["tiny"]["max_model_len"] \
            == 1024

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
        expect = {name: tokenizer.decode(peft_greedy(tiny_model_dir, peft_adapters[adapter], prompt),
                                         skip_special_tokens=True)
                  for name, adapter in (("attn", "attn-r8"), ("mlp", "mlp-r4"))}
        base_text = tokenizer.decode(peft_greedy(tiny_model_dir, None, prompt), skip_special_tokens=True)
        assert base_text not in expect.values()
        for model, adapter in (("tiny:attn", "attn"), ("attn", "attn"), ("tiny:mlp", "mlp")):
            status, body = await complete(http, stack, model, prompt)
            assert status == 200, body
            assert text_of(body) == expect[adapter], model
        # Adapter KV is the adapter's own: the same prompt on mlp found mlp's blocks, not attn's.
        status, body = await complete(http, stack, "tiny", prompt)
        assert text_of(body) == base_text and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, body = await complete(http, stack, "tiny:attn", prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # kv_aware found attn's own blocks

        status, text = await post("/v1/unload_lora_adapter", {"lora_name": "attn"}, admin)
        assert status == 200, text
        assert (await post("/v1/unload_lora_adapter", {"lora_name": "attn"}, admin))[0] == 404
        status, body = await complete(http, stack, "tiny:attn", prompt)
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body = await complete(http, stack, "tiny:mlp", prompt)
        assert status == 200 and text_of(body) == expect["mlp"]

        # The engines' metrics: slot loads, and vLLM's lora_requests_info with the slot count.
        loads = 0.0
        for replica in ("engine-0", "engine-1"):
            async with http.get(await engine_metrics_url(stack, replica)) as resp:
                text = await resp.text()
            assert 'max_lora="2"' in text and "strata:lora_requests_info{" in text
            loads += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("strata:lora_adapter_loads_total"))
        assert loads >= 2  # attn and mlp were each made resident somewhere


async def engine_metrics_url(stack, replica: str) -> str:
    from shared import keys

    redis = connect_redis(stack.infra.redis_url)
    try:
        return (await redis.hget(keys.replica(replica), "http_url")).decode() + "/metrics"
    finally:
        await redis.aclose()
