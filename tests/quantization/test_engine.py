"""The quantized engine end to end on CPU: greedy agreement with full precision, the logits' error,
the int8 KV cache (more blocks at the same memory, read by decode and by chunked prefill), no
full-precision copy of a quantized weight, and the refusals."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.engine import LLM, EngineArgs, SamplingParams
from services.engine.linear import Linear
from services.engine.model import LAYER_LINEARS
from services.engine.quantization.linear import QuantizedLinear
from tests.engine.conftest import assert_no_leak, mixed_prompts
from tests.quantization.conftest import SHAPE, prompt_logits

MAX_TOKENS = 24
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(SHAPE.vocab_size)  # the held prompts: 1 to 410 tokens, shared prefixes


def greedy(model_dir, prompts, **engine_args):
    llm = LLM(model_dir, max_num_seqs=16, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_no_leak(llm.engine)
    return llm, [o.outputs[0].token_ids for o in outputs]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    """Share of positions where the greedy tokens are the same (free-running: once a sequence
    diverges its later positions mostly differ too, so this is strict)."""
    same = sum(a == b for ref, out in zip(reference, tokens) for a, b in zip(ref, out))
    return same / sum(len(ref) for ref in reference)


@pytest.fixture(scope="module")
def full_precision(quant_model_dir, prompts):
    llm, tokens = greedy(quant_model_dir, prompts)
    probe = prompts[8] + prompts[9]  # 300 + 410 tokens, teacher-forced
    return tokens, probe, prompt_logits(llm, probe)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_greedy_agrees_with_full_precision(quant_model_dir, prompts, full_precision, quantization,
                                                     record_property):
    reference, probe, ref_logits = full_precision
    llm, tokens = greedy(quant_model_dir, prompts, quantization=quantization)
    assert all(isinstance(getattr(layer, n), QuantizedLinear) for layer in llm.engine.runner.model.layers
               for n in LAYER_LINEARS)
    rate = agreement(reference, tokens)
    logits = prompt_logits(llm, probe)
    mae = (logits - ref_logits).abs().mean().item()
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    record_property(f"{quantization}_greedy_agreement", rate)
    record_property(f"{quantization}_logits_mae", mae)
    print(f"\n{quantization}: greedy positions agreeing {rate:.3f}, logits MAE {mae:.4f} "
          f"(logit std {ref_logits.std().item():.2f}), teacher-forced top-1 agreement {top1:.4f}")
    assert llm.stats()["quantization"] == quantization
    if quantization == "int8":
        assert rate >= 0.9
        assert mae < 0.05 * ref_logits.std().item()
    else:  # int4 is coarser: its error is reported; greedy still mostly agrees
        assert rate >= 0.7
        assert mae < 0.5 * ref_logits.std().item()


def test_int8_weights_under_an_fp32_model(quant_model_dir, prompts, full_precision):
    """W8A32: the bf16 checkpoint run in fp32 with int8 weights."""
    reference, _, _ = full_precision
    _, tokens = greedy(quant_model_dir, prompts[:8], dtype="float32", quantization="int8")
    assert agreement(reference[:8], tokens) >= 0.9


def test_int8_kv_cache_holds_more_blocks_and_agrees(quant_model_dir, prompts, full_precision):
    reference, probe, ref_logits = full_precision
    budget = dict(cpu_kv_cache_max_bytes=8 << 20)  # the same memory for both caches
    plain = LLM(quant_model_dir, **budget)
    llm, tokens = greedy(quant_model_dir, prompts, kv_cache_dtype="int8", **budget)
    c = llm.engine.model_config
    # The model's dtype (auto: bf16, or fp32 on a CPU without bf16 instructions) per value; int8:
    # 1 byte per value and a 4-byte scale per token and KV head.
    ratio = (plain.engine.runner.dtype.itemsize * c.head_dim) / (c.head_dim + 4)
    blocks, plain_blocks = llm.stats()["total_blocks"], plain.stats()["total_blocks"]
    assert blocks == int((8 << 20) // (llm.engine.runner.kv_bytes_per_block))
    assert abs(blocks / plain_blocks - ratio) < 0.01, (blocks, plain_blocks)
    assert llm.stats()["kv_cache_dtype"] == "int8"
    assert agreement(reference, tokens) >= 0.9  # decode reads the int8 cache (prefix hits too)
    # Chunked prefill: the second chunk attends to the first one's int8 KV.
    chunked = prompt_logits(llm, probe, first_chunk=300)
    assert (chunked[300:] - ref_logits[300:]).abs().mean() < 0.05 * ref_logits.std()
    assert (chunked.argmax(-1) == ref_logits.argmax(-1)).float().mean() > 0.98


def test_no_full_precision_copy_of_a_quantized_weight(quant_model_dir):
    llm = LLM(quant_model_dir, quantization="int4", num_kv_blocks=64)
    model = llm.engine.runner.model
    expected = 0  # what the packed weights must take: int4 values, a 4-byte scale per 128, biases
    for layer in model.layers:
        for name in LAYER_LINEARS:
            lin = getattr(layer, name)
            assert isinstance(lin, QuantizedLinear) and lin.weight is None
            expected += lin.out_features * lin.in_features // 2 + lin.out_features * lin.in_features // 128 * 4
            expected += 0 if lin.bias is None else lin.bias.numel() * lin.bias.element_size()
    # In the model's dtype (auto: bf16, or fp32 on a CPU without bf16 instructions).
    dense = sum(t.numel() * t.element_size() for t in [model.embed, model.norm] + [
        t for layer in model.layers for t in (layer.input_norm, layer.post_norm)]) + model.lm_head.nbytes
    assert isinstance(model.lm_head, Linear)  # lm_head stays in the model's dtype
    held = tensor_bytes(model)
    assert abs(held - (expected + dense)) <= 0.05 * (expected + dense), (held, expected + dense)
    assert abs(model.weight_bytes() - (expected + dense)) <= 0.05 * (expected + dense)


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from obj's attributes (each storage once)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.is_mkldnn:  # oneDNN's packed layout
            key = ("mkldnn", id(obj))
            size = torch.ops.mkldnn._nbytes(obj)
        else:
            key, size = obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()
        if key in seen:
            return 0
        seen.add(key)
        return size
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if type(obj).__module__.startswith(("services.", "kernels.")) and hasattr(obj, "__dict__"):  # our objects
        return sum(tensor_bytes(v, seen) for k, v in vars(obj).items() if k not in ("config", "ops", "attn", "rope"))
    return 0


RSS_SCRIPT = textwrap.dedent("""
    import ctypes, json, sys
    sys.path.insert(0, {root!r})
    import torch
    from services.engine import LLM, SamplingParams, model_runner
    from services.engine.quantization.linear import QuantizedLinear

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    if {widen!r}:  # the classic mistake, on purpose: a full-precision weight made for each matmul
        run = QuantizedLinear.__call__
        QuantizedLinear.__call__ = lambda self, x: (torch.ones(self.out_features, self.in_features,
                                                               dtype=x.dtype).sum(), run(self, x))[1]
    # The engine keeps freed memory on its heap (model_runner), where a transient buffer would
    # reuse what an earlier one left; here glibc maps every buffer over 128 KiB anew and unmaps it
    # when freed, so a transient copy raises the peak over the steady RSS.
    model_runner._keep_freed_memory_on_cpu = lambda: None
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    llm = LLM({model!r}, quantization="int8", num_kv_blocks=64, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[7 + i] * 40 for i in range(8)]
    llm.generate(prompts, params)  # warm up: every step's persistent buffers exist
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{{i}}", p, params)
    engine.step()  # the prefill
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    before, steps = status("VmRSS:"), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    print(json.dumps({{"growth": status("VmHWM:") - before, "steps": steps}}))
""")


def peak_rss_growth(model_dir, widen: bool) -> dict:
    script = RSS_SCRIPT.format(root=str(ROOT), model=str(model_dir), widen=widen)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "clear_refs" in out.stderr:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_during_decode_steps_stays_below_a_layers_full_precision_size(quant_model_dir):
    largest = 2 * SHAPE.intermediate_size * SHAPE.hidden_size * 2  # gate_up in bf16: 4 MiB
    measured = peak_rss_growth(quant_model_dir, widen=False)
    print(f"\npeak RSS growth over {measured['steps']} decode steps: {measured['growth'] / 2**20:.2f} MiB "
          f"(gate_up in bf16: {largest / 2**20:.1f} MiB)")
    assert measured["steps"] >= 7 and measured["growth"] < largest / 2
    # The same measurement sees a weight widened for its matmul.
    assert peak_rss_growth(quant_model_dir, widen=True)["growth"] >= largest / 2


def test_refusals_name_the_field(quant_model_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="quantization: fp8 is not supported on cpu"):
        EngineArgs(quantization="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype: fp8 is not supported on cpu"):
        LLM(quant_model_dir, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="unknown quantization 'gptq'"):
        EngineArgs(quantization="gptq")
    with pytest.raises(ValueError, match="kv_cache_dtype: int8 is not supported on cuda"):
        EngineArgs(kv_cache_dtype="int8", device="cuda")
    # int4's groups of 128 must tile the input channels: the tiny model's MLP has 688.
    with pytest.raises(ValueError, match="down_proj: 4-bit weights of 688 input channels"):
        LLM(tiny_model_dir, quantization="int4", num_kv_blocks=16)
