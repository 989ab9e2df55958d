"""The realistic-shape builder (shared/realistic_models.py) at small sizes: what it builds loads in
transformers and in Strata's engine, with a tokenizer of exactly the configured size."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.engine import LLM, SamplingParams
from shared.realistic_models import SHAPES, ModelShape, ensure_model, scaled

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=160, vocab_size=1500)
CORPUS_BYTES = 1_500_000  # enough text for a 1,500-token BPE, quick to read and train


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("strata-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_HOME", str(home))  # the tokenizer cache and models land here, not in ~/.strata
        yield home


@pytest.fixture(scope="module")
def llama_dir(home):
    return ensure_model(scaled(SHAPES["M"], num_kv_heads=2, **SMALL), max_corpus_bytes=CORPUS_BYTES)


@pytest.fixture(scope="module")
def qwen2_dir(home):
    return ensure_model(scaled(SHAPES["L"], num_kv_heads=1, **SMALL), max_corpus_bytes=CORPUS_BYTES)


def test_full_shapes_have_the_published_sizes():
    # Qwen2.5-0.5B has 494,032,768 parameters; M is the 56M Llama of issue 16.
    assert SHAPES["L"].num_params() == 494_032_768
    assert 56_000_000 < SHAPES["M"].num_params() < 57_000_000
    assert (SHAPES["M"].vocab_size, SHAPES["L"].vocab_size) == (32_000, 151_936)


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_tokenizer_has_the_configured_size_and_round_trips(which, llama_dir, qwen2_dir):
    model_dir = llama_dir if which == "llama" else qwen2_dir
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert config["vocab_size"] == SMALL["vocab_size"] == len(tokenizer)
    text = "def forward(self, hidden_states): Größe 日本語 🚀"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    if which == "llama":
        assert tokenizer("x").input_ids[0] == tokenizer.bos_token_id and chat.endswith("<|assistant|>\n")
    else:  # Qwen's ChatML: special tokens at the end of the vocabulary, no BOS
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") == SMALL["vocab_size"] - 1
        assert tokenizer.bos_token is None and chat.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_transformers_and_strata_load_it_and_agree_on_greedy_tokens(which, llama_dir, qwen2_dir):
    model_dir = llama_dir if which == "llama" else qwen2_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    assert type(model).__name__ == ("LlamaForCausalLM" if which == "llama" else "Qwen2ForCausalLM")
    shape = ModelShape(**json.loads((model_dir / "strata_model.json").read_text())["shape"])
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()
    weights = load_file(model_dir / "model.safetensors")
    if which == "qwen2":
        assert "lm_head.weight" not in weights and "model.layers.0.self_attn.q_proj.bias" in weights
    prompt = [5, 300, 17, 900, 42, 1200, 7, 64]
    expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(model_dir, max_num_seqs=4, num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    assert len(set(expected)) > 1  # logits spread: not one token over and over


def test_built_once_and_deterministic(home, llama_dir, tmp_path):
    before = (llama_dir / "model.safetensors").stat().st_mtime_ns
    shape = scaled(SHAPES["M"], num_kv_heads=2, **SMALL)
    assert ensure_model(shape, max_corpus_bytes=CORPUS_BYTES) == llama_dir
    assert (llama_dir / "model.safetensors").stat().st_mtime_ns == before  # found, not rebuilt
    again = ensure_model(shape, tmp_path / "again", max_corpus_bytes=CORPUS_BYTES)
    assert (again / "tokenizer.json").read_text() == (llama_dir / "tokenizer.json").read_text()
    a, b = load_file(again / "model.safetensors"), load_file(llama_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((llama_dir / "strata_model.json").read_text())
    assert len(manifest["tokenizer_corpus_sha256"]) == 64


def test_a_corpus_too_small_for_the_vocabulary_is_refused(home, tmp_path):
    with pytest.raises(RuntimeError, match="yields only"):
        ensure_model(scaled(SHAPES["M"], num_kv_heads=2, **{**SMALL, "vocab_size": 60_000}), tmp_path / "big",
                     max_corpus_bytes=200_000)


def test_a_carried_tokenizer_builds_the_same_model_without_training(home, llama_dir, tmp_path, monkeypatch):
    """What a machine lent for minutes does (bench/gpu_checks.sh): the tokenizer trained here, carried
    there, gives the same model; the manifest names the file rather than a corpus."""
    import shared.realistic_models as rm

    shape = scaled(SHAPES["M"], num_kv_heads=2, **SMALL)
    [saved] = (home / "tokenizers").glob(rm.tokenizer_file_name("llama", shape.vocab_size, "*"))
    monkeypatch.setattr(rm, "train_bpe", lambda *a, **k: pytest.fail("trained a tokenizer"))
    carried = ensure_model(shape, tmp_path / "carried", tokenizer_file=saved)
    assert (carried / "tokenizer.json").read_text() == (llama_dir / "tokenizer.json").read_text()
    a, b = load_file(carried / "model.safetensors"), load_file(llama_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((carried / "strata_model.json").read_text())
    assert manifest["tokenizer_corpus_sha256"] is None and len(manifest["tokenizer_file_sha256"]) == 64
    with pytest.raises(ValueError, match="not 1,600"):
        ensure_model(scaled(shape, vocab_size=1600), tmp_path / "other", tokenizer_file=saved)
