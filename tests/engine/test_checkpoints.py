"""Real checkpoints: sharded bf16 safetensors with an index, weights named without the `model.`
prefix, Qwen3 (per-head q/k norms, head_dim != hidden / heads), refusals of what is not
supported, and the bf16 CPU path against transformers' bf16."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from kernels.cpu import blocked_linear
from services.engine import LLM, SamplingParams
from services.engine.checkpoint import INDEX_FILE
from services.engine.linear import cpu_prepacking_available
from services.engine.model import LAYER_LINEARS
from services.engine.model_config import ModelConfig
from services.engine.model_runner import cpu_has_native_bf16
from tests.engine.conftest import HFReference

PROMPTS = [[1] + list(range(40, 90)), list(range(200, 203)), list(range(500, 700)), [7] * 20]


def build(path, tiny_model_dir, model_cls, config, dtype=torch.float32, **save_kwargs):
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.08 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, **save_kwargs)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / f).exists():
            shutil.copy(tiny_model_dir / f, path / f)
    return path


def vocab(tiny_model_dir) -> int:
    return json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]


def greedy_matches_transformers(model_dir, n=12):
    hf = HFReference(model_dir)  # fp32, whatever the checkpoint's dtype
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=128)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf.greedy(prompt, n), f"prompt of {len(prompt)} tokens"
    return llm


def test_sharded_bf16_checkpoint_matches_transformers_fp32(tmp_path, tiny_model_dir):
    config = LlamaConfig(vocab_size=vocab(tiny_model_dir), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, dtype="bfloat16")
    model_dir = build(tmp_path / "sharded", tiny_model_dir, LlamaForCausalLM, config, dtype=torch.bfloat16,
                      max_shard_size="300KB")
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shards) > 2 and (model_dir / INDEX_FILE).exists()
    # A stray file beside the shards must not be read: the index says which files hold weights.
    save_file({"junk": torch.zeros(3)}, str(model_dir / "consolidated.safetensors"))
    assert ModelConfig.load(model_dir).torch_dtype == "bfloat16"
    llm = greedy_matches_transformers(model_dir)
    # run in fp32, the weights are held as their bf16 values where the AVX2 kernel runs: alone where
    # it outruns oneDNN, else beside oneDNN's layout for decode
    expected = ("blocked" if blocked_linear.f32_outruns_onednn()
                else "onednn+blocked" if blocked_linear.available_f32() and cpu_prepacking_available(torch.float32)
                else None)
    if expected:
        model = llm.engine.runner.model
        assert {model.lm_head.layout} | {getattr(model.layers[0], n).layout for n in LAYER_LINEARS} == {expected}


def test_weights_without_the_model_prefix_load(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    save_file({k.removeprefix("model."): v.contiguous() for k, v in weights.items()},
              str(model_dir / "model.safetensors"))
    assert not any(k.startswith("model.") for k in load_file(str(model_dir / "model.safetensors")))
    reference = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128)
    bare = LLM(model_dir, dtype="float32", num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in bare.generate(PROMPTS, params)]
            == [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params)])


def test_qwen3_with_its_own_head_dim_matches_transformers(tmp_path, tiny_model_dir):
    config = Qwen3Config(vocab_size=vocab(tiny_model_dir), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    model_dir = build(tmp_path / "qwen3", tiny_model_dir, Qwen3ForCausalLM, config)
    loaded = ModelConfig.load(model_dir)
    assert loaded.qk_norm and loaded.head_dim == 32 and not loaded.attention_bias
    greedy_matches_transformers(model_dir)


def test_an_unsupported_architecture_is_refused_with_the_supported_list(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "gpt2"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        LLM(model_dir)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message and "Qwen3ForCausalLM" in message and "LlamaForCausalLM" in message


def test_a_missing_weight_is_named(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(model_dir)


def test_a_sliding_window_model_stops_at_its_window(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "mistral"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256)
    (model_dir / "config.json").write_text(json.dumps(config))
    assert LLM(model_dir, num_kv_blocks=64).engine.max_model_len == 256


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_bf16_on_cpu_agrees_with_transformers_bf16(tmp_path, tiny_model_dir, dtype):
    """dtype=auto keeps a bf16 checkpoint in bf16 where the CPU has bf16 instructions, and an
    explicit bfloat16 runs on any CPU (on an AVX2-only one without oneDNN's packed bf16 path);
    its next-token logprobs agree with transformers running the same checkpoint in bf16 (up to
    bf16 rounding)."""
    if dtype == "auto" and not cpu_has_native_bf16():
        pytest.skip("the CPU has no bf16 instructions: auto runs a bf16 checkpoint in fp32")
    config = LlamaConfig(vocab_size=vocab(tiny_model_dir), hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, dtype="bfloat16")
    model_dir = build(tmp_path / "bf16", tiny_model_dir, LlamaForCausalLM, config, dtype=torch.bfloat16)
    llm = LLM(model_dir, num_kv_blocks=128, dtype=dtype)
    assert llm.engine.runner.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.bfloat16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert logprob == pytest.approx(ref[token].item(), abs=0.08)
