"""The engine on the Triton backend (CPU: the Triton interpreter) gives the torch backend's
greedy tokens, through plain prefill, a cached prefix with a new chunk, and decode."""

import os

import pytest

from services.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                os.environ.get("STRATA_KERNEL_DEVICE") != "cuda",
                                reason="needs CUDA or the Triton interpreter")


def test_triton_backend_matches_torch_backend(tiny_model_dir):
    device = "cuda" if os.environ.get("STRATA_KERNEL_DEVICE") == "cuda" else "cpu"
    shared = list(range(300, 340))  # 2.5 blocks of 16: the second wave hits 2 cached blocks
    prompts = [shared + [7, 8, 9], [5, 6, 7, 8, 9, 10, 11], shared + list(range(900, 921))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model_dir, attention_backend=backend, device=device, dtype="float32", num_kv_blocks=32,
                  max_num_batched_tokens=32)  # 32-token chunks: prefill resumes over its own cached part
        assert llm.engine.runner.ops.name == backend
        first = llm.generate(prompts[:2], params)
        second = llm.generate(prompts[2:], params)
        assert llm.stats()["prefix_cache_hits"] >= 32
        outputs[backend] = [o.outputs[0].token_ids for o in first + second]
    assert outputs["triton"] == outputs["torch"]


def fake_cuda_graph_capture(forward, pool):
    """Stands in for CUDA graph capture (no GPU here): replay re-runs the forward pass on the
    same static buffers, so the padding and buffer handling around the graphs is what is tested."""
    out = forward()

    def replay():
        out.copy_(forward())

    return replay, out, None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU: the interpreter's (with a GPU, test_cuda_engine.py captures real graphs)")
def test_decode_graph_runner_pads_and_matches_eager(tiny_model_dir):
    import torch

    from services.engine.cuda_graphs import DecodeGraphs, capture_sizes

    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64] and capture_sizes(3) == [1, 2, 3]
    prompts = [list(range(10, 30)), list(range(40, 43)), list(range(60, 97))]  # 3 seqs: padded to 4
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = LLM(tiny_model_dir, attention_backend="triton", device="cpu", num_kv_blocks=32, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    llm = LLM(tiny_model_dir, attention_backend="triton", device="cpu", num_kv_blocks=32, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.ops.name == "triton"
    with torch.inference_mode():
        runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, 4, 8, torch.device("cpu"),
                                     capture=fake_cuda_graph_capture)
    calls = []
    original = runner.graphs.run
    runner.graphs.run = lambda *a, **k: calls.append(len(k["input_ids"])) or original(*a, **k)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert calls and set(calls) == {3}  # every decode step went through the graph runner
