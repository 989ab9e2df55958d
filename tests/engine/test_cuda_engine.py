"""The whole engine on a GPU (skipped without one): greedy tokens equal transformers' fp32 reference
with and without decode CUDA graphs, seeded sampling does not depend on the batch, bf16 runs, and
every block is freed. The kernels alone are tested in tests/kernels (on the GPU when there is one)."""

import json

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.conftest import assert_no_leak, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    return mixed_prompts(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_greedy_on_cuda_matches_transformers_fp32(tiny_model_dir, hf, prompts, cuda_graphs):
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32", enable_cuda_graphs=cuda_graphs, max_num_seqs=16,
              num_kv_blocks=512)
    runner = llm.engine.runner
    assert runner.ops.name == "triton" and (runner.graphs is not None) == cuda_graphs
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.outputs[0].token_ids == hf.greedy(prompt, MAX_TOKENS), f"prompt {i} ({len(prompt)} tokens)"
    assert_no_leak(llm.engine)


def test_seeded_sampling_on_cuda_does_not_depend_on_the_batch(tiny_model_dir, prompts):
    llm = LLM(tiny_model_dir, device="cuda", dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=7, max_tokens=32,
                            ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    crowd = llm.generate(prompts[1:8] + [prompts[0]], [noise] * 7 + [seeded])
    assert len(alone) == 32 and crowd[7].outputs[0].token_ids == alone
    greedy = llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in greedy)
    assert_no_leak(llm.engine)
