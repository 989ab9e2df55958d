"""Other Llama-family shapes load and match transformers: llama3 rope scaling with tied
embeddings, yarn-free Qwen2 (q/k/v biases), and an older-style config with rope_scaling."""

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from services.engine import LLM, SamplingParams
from tests.engine.conftest import HFReference

PROMPTS = [[1] + list(range(40, 90)), list(range(200, 203)), list(range(500, 700))]


def build(tmp_path, tiny_model_dir, model_cls, config):
    out = tmp_path / config.model_type
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / f).exists():
            shutil.copy(tiny_model_dir / f, out / f)
    return out


def common(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    return dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)


@pytest.mark.parametrize("variant", ["llama3-rope-tied", "qwen2-bias", "legacy-rope-scaling"])
def test_variant_matches_transformers(tmp_path, tiny_model_dir, variant):
    if variant == "llama3-rope-tied":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = LlamaConfig(**common(tiny_model_dir), tie_word_embeddings=True, rope_parameters=rope)
        model_dir = build(tmp_path, tiny_model_dir, LlamaForCausalLM, config)
    elif variant == "qwen2-bias":
        config = Qwen2Config(**common(tiny_model_dir), tie_word_embeddings=False)
        model_dir = build(tmp_path, tiny_model_dir, Qwen2ForCausalLM, config)
    else:
        config = LlamaConfig(**common(tiny_model_dir),
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
        model_dir = build(tmp_path, tiny_model_dir, LlamaForCausalLM, config)
        # Rewrite the config the way transformers 4.x wrote it: rope_theta + rope_scaling.
        raw = json.loads((model_dir / "config.json").read_text())
        raw.pop("rope_parameters")
        raw.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0})
        (model_dir / "config.json").write_text(json.dumps(raw))
        from services.engine.model_config import ModelConfig
        assert ModelConfig.load(model_dir).rope_scaling["rope_type"] == "linear"
    hf = HFReference(model_dir)
    llm = LLM(model_dir, num_kv_blocks=128)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf.greedy(prompt, 12)
