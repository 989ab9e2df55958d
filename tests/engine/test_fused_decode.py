"""The fused CPU decode step (kernels/cpu/decode_layers.c: every layer in one C call) gives the
bits of the op-by-op forward, for Llama, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, its
own head_dim), at changing batch sizes and contexts that cross KV blocks; it stands aside where a
layer is not a plain blocked Linear (LoRA) or the cache is quantized; a bad operand is refused."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from services.engine import LLM, SamplingParams
from tests.engine.conftest import assert_no_leak

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024)
VARIANTS = {
    "llama": (LlamaForCausalLM, lambda vocab: LlamaConfig(**SHAPE, vocab_size=vocab)),
    "qwen2-bias": (Qwen2ForCausalLM, lambda vocab: Qwen2Config(**SHAPE, vocab_size=vocab, tie_word_embeddings=False)),
    "qwen3-qk-norm": (Qwen3ForCausalLM,
                      lambda vocab: Qwen3Config(**SHAPE, vocab_size=vocab, head_dim=32, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    """bf16 checkpoints (an fp32 engine holds their weights as blocked bf16 values: the fused step's
    operands) of each variant, random weights, biases non-zero; the tiny model's tokenizer."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    out = {}
    for name, (model_cls, make_config) in VARIANTS.items():
        torch.manual_seed(0)
        model = model_cls(make_config(vocab))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.copy_((1 + 0.1 * torch.randn_like(p)) if "norm" in pname else 0.08 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(name)
        model.to(torch.bfloat16).save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model_dir / f, path / f)
        out[name] = path
    return out


def engine(model_dir, dtype: str, fuse: bool, **kwargs) -> LLM:
    return LLM(model_dir, dtype=dtype, num_kv_blocks=256, max_num_seqs=80, fuse_cpu_decode=fuse, **kwargs)


class CountingCalls:
    """Wraps the model's DecodeLayers to count the steps it runs."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    outs = llm.generate(prompts, params)
    assert_no_leak(llm.engine)
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]


def prompts_and_params(count: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1-40 tokens; requests end at different steps (the batch shrinks), half sampled
    with seeds; logprobs of every token, so that equal outputs mean equal logits."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randrange(1, 41))] for _ in range(count)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, top_p=0.95, seed=100 + i, logprobs=3,
                             max_tokens=rng.randrange(10, 30), ignore_eos=True) for i in range(count)]
    return prompts, params


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_step_gives_the_op_by_op_bits(checkpoints, variant, dtype):
    fused = engine(checkpoints[variant], dtype, fuse=True)
    model = fused.engine.runner.model
    if model.decode_layers is None:
        pytest.skip(f"no blocked {dtype} weights on this CPU: every step runs op by op")
    counter = model.decode_layers = CountingCalls(model.decode_layers)
    plain = engine(checkpoints[variant], dtype, fuse=False)
    assert plain.engine.runner.model.decode_layers is None
    prompts, params = prompts_and_params(6)
    assert run(fused, prompts, params) == run(plain, prompts, params)
    assert counter.calls >= 20  # the decode steps ran fused (the longest request decodes 20+ tokens)


def test_a_batch_past_the_blocked_rows_and_one_beside_it_match(checkpoints):
    """70 sequences: where oneDNN takes calls of more than 64 rows (an fp32 weight held in both
    layouts) those steps run op by op, and the fused steps before and after them still match."""
    fused = engine(checkpoints["qwen2-bias"], "float32", fuse=True)
    if fused.engine.runner.model.decode_layers is None:
        pytest.skip("no blocked fp32 weights on this CPU")
    plain = engine(checkpoints["qwen2-bias"], "float32", fuse=False)
    prompts, params = prompts_and_params(70, seed=1)
    assert run(fused, prompts, params) == run(plain, prompts, params)


def test_lora_and_quantized_caches_run_op_by_op(checkpoints):
    model_dir = checkpoints["llama"]
    if engine(model_dir, "float32", fuse=True).engine.runner.model.decode_layers is None:
        pytest.skip("no blocked fp32 weights on this CPU")
    assert engine(model_dir, "float32", fuse=True, enable_lora=True).engine.runner.model.decode_layers is None
    assert engine(model_dir, "float32", fuse=True, kv_cache_dtype="int8").engine.runner.model.decode_layers is None


def test_a_bad_operand_is_refused_and_a_bad_slot_names_its_layer(checkpoints):
    llm = engine(checkpoints["llama"], "float32", fuse=True)
    layers = llm.engine.runner.model.decode_layers
    if layers is None:
        pytest.skip("no blocked fp32 weights on this CPU")
    h = torch.zeros(2, 128)
    positions, slots = torch.tensor([3, 5]), torch.tensor([3, 21])
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        layers(h, positions.int(), slots, tables, lens)
    with pytest.raises(ValueError, match="hidden"):
        layers(torch.zeros(2, 64), positions, slots, tables, lens)
    with pytest.raises(RuntimeError, match="layer 0: a cache slot outside the cache"):
        layers(h, positions, torch.tensor([3, 10 ** 9]), tables, lens)


def test_draft_verification_rows_match(checkpoints):
    """ngram speculation: on CPU the drafts are verified as decode rows (several per sequence, each
    with its own context), which the fused step takes like any other decode rows."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    fused = engine(checkpoints["qwen2-bias"], "float32", fuse=True, speculative_config=spec)
    model = fused.engine.runner.model
    if model.decode_layers is None:
        pytest.skip("no blocked fp32 weights on this CPU")
    counter = model.decode_layers = CountingCalls(model.decode_layers)
    plain = engine(checkpoints["qwen2-bias"], "float32", fuse=False, speculative_config=spec)
    prompts = [[5, 6, 7, 8] * 8, [9, 10, 11] * 5 + [12], list(range(40, 60)) * 2]
    params = [SamplingParams(temperature=0, logprobs=2, max_tokens=24, ignore_eos=True)] * len(prompts)
    assert run(fused, prompts, params) == run(plain, prompts, params)
    assert counter.calls > 0
