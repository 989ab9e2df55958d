"""LoRA adapters in the engine: PEFT's own adapters give transformers + peft's greedy tokens,
a batch mixing the base model and every adapter gives each request its tokens alone, adapters
never share KV, and an adapter that cannot serve is refused with the reason and changes nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.engine import LLM, LoRARequest, SamplingParams
from services.engine.lora import LoRAAdapterError
from shared.tiny_model import ensure_tiny_model
from tests.engine.conftest import assert_no_leak
from tests.lora.conftest import build_peft_adapter

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(7)
    # A 40-token prompt (two full blocks and a tail) and a 5-token one.
    return [torch.randint(8, vocab, (40,), generator=g).tolist(), torch.randint(8, vocab, (5,), generator=g).tolist()]


@pytest.fixture(scope="module")
def peft_reference(tiny_model_dir, peft_adapters, prompts):
    """Greedy tokens of transformers + peft (adapter not merged) for each adapter and prompt."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in peft_adapters.items():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(path)).eval()
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
            out[name, i] = gen[0, len(prompt):].tolist()
    return out


def lora_llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, **{"enable_lora": True, "max_lora_rank": 16, **kwargs})


def test_each_adapter_matches_transformers_peft(tiny_model_dir, peft_adapters, prompts, peft_reference, hf):
    # Two slots for four adapters: requests wait for a slot, adapters are evicted and reloaded.
    llm = lora_llm(tiny_model_dir, max_loras=2, max_cpu_loras=2)
    requests = [(name, i) for name in peft_adapters for i in range(len(prompts))]
    outs = llm.generate([prompts[i] for _, i in requests], GREEDY,
                        lora_request=[LoRARequest(name, str(peft_adapters[name])) for name, _ in requests])
    for (name, i), out in zip(requests, outs):
        assert out.outputs[0].token_ids == peft_reference[name, i], f"adapter {name}, prompt {i}"
    # Every adapter changes the output (the comparison is not base against base).
    base = [hf.greedy(p, MAX_TOKENS) for p in prompts]
    assert all(peft_reference[name, 0] != base[0] for name in peft_adapters)
    stats = llm.stats()
    assert stats["lora_loads"] >= 4 and stats["lora_evictions"] >= 2 and len(stats["lora_resident"]) <= 2
    assert_no_leak(llm.engine)


def test_mixed_batch_equals_each_request_alone(tiny_model_dir, peft_adapters, prompts, peft_reference, hf):
    llm = lora_llm(tiny_model_dir, max_loras=4)
    loras = [None] + [LoRARequest(n, str(p)) for n, p in peft_adapters.items()]
    alone = [llm.generate(prompts[0], GREEDY, lora_request=lora)[0].outputs[0].token_ids for lora in loras]
    # All of them at once, twice each, interleaved with base requests: one batch, five "models".
    mixed = loras * 2
    outs = llm.generate([prompts[0]] * len(mixed), GREEDY, lora_request=mixed)
    for lora, out in zip(mixed, outs):
        expect = alone[loras.index(lora)]
        assert out.outputs[0].token_ids == expect, lora
    assert alone[0] == hf.greedy(prompts[0], MAX_TOKENS)
    for lora, tokens in zip(loras[1:], alone[1:]):
        assert tokens == peft_reference[lora.lora_name, 0]
    assert_no_leak(llm.engine)


def test_adapters_never_share_cached_blocks(tiny_model_dir, peft_adapters, prompts):
    llm = lora_llm(tiny_model_dir, max_loras=2)
    a, b = (LoRARequest(n, str(peft_adapters[n])) for n in ("attn-r8", "mlp-r4"))
    prompt = prompts[0]  # 40 tokens: two full blocks could be reused
    first_a = llm.generate(prompt, GREEDY, lora_request=a)[0]
    assert first_a.num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, lora_request=b)[0].num_cached_tokens == 0  # another adapter: a miss
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0  # the base model: a miss
    again = llm.generate(prompt, GREEDY, lora_request=a)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first_a.outputs[0].token_ids
    # Unloading an adapter drops its cached blocks: one loaded later under its name starts cold.
    assert llm.engine.lora.unregister("attn-r8")
    llm.register_lora(a)
    assert llm.generate(prompt, GREEDY, lora_request=a)[0].num_cached_tokens == 0
    assert_no_leak(llm.engine)


def test_unknown_or_disabled_adapter_is_a_request_error(tiny_model_dir, peft_adapters, prompts):
    from services.engine.sampling_params import InvalidRequestError

    llm = lora_llm(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded"):
        llm.engine.add_request("r1", prompts[1], GREEDY, lora_name="nope")
    plain = LLM(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.engine.add_request("r2", prompts[1], GREEDY, lora_name="attn-r8")
    assert not llm.engine.has_unfinished_requests() and not plain.engine.has_unfinished_requests()


def test_unload_while_running_lets_the_request_finish(tiny_model_dir, peft_adapters, prompts, peft_reference):
    llm = lora_llm(tiny_model_dir)
    engine = llm.engine
    llm.register_lora(LoRARequest("mlp-r4", str(peft_adapters["mlp-r4"])))
    engine.add_request("r", prompts[0], GREEDY, lora_name="mlp-r4")
    engine.step()
    assert engine.lora.unregister("mlp-r4")
    with pytest.raises(Exception, match="not loaded"):  # new requests are refused at once
        engine.add_request("r2", prompts[0], GREEDY, lora_name="mlp-r4")
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == peft_reference["mlp-r4", 0]
    engine.step()  # the step that drops what the adapter left behind
    assert engine.lora.stats()["lora_resident"] == [] and engine.lora.stats()["lora_cached"] == []
    assert len(engine.block_manager.cached) == 0
    assert_no_leak(engine)


@pytest.fixture(scope="module")
def other_shape_adapter(tmp_path_factory):
    """A PEFT adapter trained for a base model of another width."""
    root = tmp_path_factory.mktemp("other-base")
    other = ensure_tiny_model(root / "wide", hidden=128, heads=2, kv_heads=1, layers=2)
    return build_peft_adapter(other, root / "adapter", seed=3, r=8, lora_alpha=8, target_modules=["q_proj"])


def test_bad_adapters_are_refused_with_the_reason(tiny_model_dir, peft_adapters, other_shape_adapter, tmp_path):
    llm = lora_llm(tiny_model_dir, max_lora_rank=8)
    llm.register_lora(LoRARequest("good", str(peft_adapters["attn-r8"])))
    missing = tmp_path / "no-weights"
    shutil.copytree(peft_adapters["attn-r8"], missing)
    (missing / "adapter_model.safetensors").unlink()
    cases = {
        "shape": (other_shape_adapter, r"has shape \[8, 128\], but this base model needs \[8, 256\]"),
        "rank": (peft_adapters["all-r16"], "rank 16 is above this engine's max_lora_rank 8"),
        "missing": (missing, "missing adapter_model.safetensors"),
        "nowhere": (tmp_path / "does-not-exist", "does not exist"),
    }
    for name, (path, reason) in cases.items():
        with pytest.raises(LoRAAdapterError, match=reason):
            llm.register_lora(LoRARequest(name, str(path)))
    with pytest.raises(LoRAAdapterError, match="already loaded from"):
        llm.register_lora(LoRARequest("good", str(peft_adapters["mlp-r4"])))
    assert llm.engine.lora.names() == ["good"]  # nothing else changed
    out = llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("good", str(peft_adapters["attn-r8"])))
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS


def test_lora_engine_arguments_are_checked():
    from services.engine.config import EngineArgs

    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(max_lora_rank=0)


def test_a_passed_over_request_is_not_starved(tiny_model_dir, peft_adapters, prompts, monkeypatch):
    """One slot, kept busy by a stream of requests for one adapter: a request for another adapter
    waits, but once it has waited long enough nothing more is admitted ahead of it."""
    from services.engine import scheduler as sched

    monkeypatch.setattr(sched, "LORA_MAX_PASS_OVER_S", 0.0)
    llm = lora_llm(tiny_model_dir, max_loras=1)
    engine = llm.engine
    for name in ("attn-r8", "mlp-r4"):
        llm.register_lora(LoRARequest(name, str(peft_adapters[name])))
    engine.add_request("busy-0", prompts[1], GREEDY, lora_name="attn-r8")
    engine.step()
    engine.add_request("other", prompts[1], GREEDY, lora_name="mlp-r4")
    engine.add_request("busy-1", prompts[1], GREEDY, lora_name="attn-r8")  # resident: could run at once
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished.index("other") < finished.index("busy-1")
    assert_no_leak(engine)


def test_adapters_over_int8_weights_match_each_alone(tiny_model_dir, peft_adapters, prompts):
    """The deltas sit beside a quantized base Linear as beside a dense one: a mixed batch equals
    each request alone, and every adapter changes the quantized model's output."""
    llm = lora_llm(tiny_model_dir, max_loras=4, quantization="int8")
    loras = [None] + [LoRARequest(n, str(p)) for n, p in peft_adapters.items()]
    alone = [llm.generate(prompts[0], GREEDY, lora_request=lora)[0].outputs[0].token_ids for lora in loras]
    outs = llm.generate([prompts[0]] * len(loras), GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(tokens != alone[0] for tokens in alone[1:])
    assert llm.stats()["quantization"] == "int8"
    assert_no_leak(llm.engine)


def test_speculative_decoding_with_lora_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative_config.*enable_lora"):
        lora_llm(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
