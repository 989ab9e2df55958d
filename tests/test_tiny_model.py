"""The tiny model loads and generates with transformers, offline, deterministically."""

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.tiny_model import make_tiny_model


def test_transformers_loads_and_generates_offline(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 20_000_000
    ids = tokenizer("The queue holds tasks", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id
    out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert out.shape[1] == ids.shape[1] + 12
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert isinstance(text, str) and text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|assistant|>\n")


def test_tokenizer_round_trips_multibyte_text(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    text = "Größe 日本語 🚀 ok"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_same_seed_same_weights(tmp_path):
    small = dict(layers=1, hidden=64, heads=4, kv_heads=2, vocab=600)
    a = load_file(make_tiny_model(tmp_path / "a", seed=7, **small) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=7, **small) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=8, **small) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
