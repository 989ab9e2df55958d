"""Already-quantized checkpoints: made here with the compressed-tensors package (the format
llm-compressor saves), loaded by the engine, equal to quantizing on load; other formats refused."""

import json
import shutil

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             QuantizationStatus, apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM

from services.engine import LLM, SamplingParams
from services.engine.model import LAYER_LINEARS
from services.engine.quantization.linear import QuantizedLinear
from tests.engine.conftest import assert_no_leak

INT8_CHANNEL = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                                               strategy="channel"))
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 9, 200, 31, 7] * 6, list(range(40, 140)), [3]]


def compress(src, out, scheme: QuantizationScheme, fmt: str):
    """What llm-compressor's weight-only recipes save: a static min/max observer's scales
    (compressed-tensors' calculate_qparams), then compress_model and update_config."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        quantization_status=QuantizationStatus.FROZEN))
    args = scheme.weights
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        if args.strategy == "group":
            w = w.view(w.shape[0], -1, args.group_size)
            low, high = w.amin(-1), w.amax(-1)
        else:
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():  # tokenizer, generation config
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def ct_int8(quant_model_dir, tmp_path_factory):
    return compress(quant_model_dir, tmp_path_factory.mktemp("ct") / "int8-channel", INT8_CHANNEL, "pack-quantized")


@pytest.fixture(scope="module")
def ct_int4(quant_model_dir, tmp_path_factory):
    return compress(quant_model_dir, tmp_path_factory.mktemp("ct") / "w4a16",
                    QuantizationScheme(targets=["Linear"], **preset_name_to_scheme("W4A16", ["Linear"])
                                       .model_dump(exclude={"targets"})), "pack-quantized")


def run(model_dir, **engine_args):
    llm = LLM(model_dir, num_kv_blocks=128, **engine_args)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert_no_leak(llm.engine)
    return llm, out


def packed_layers(llm):
    return [getattr(layer, n).packed for layer in llm.engine.runner.model.layers for n in LAYER_LINEARS]


@pytest.mark.parametrize("which,quantization", [("ct_int8", "int8"), ("ct_int4", "int4")])
def test_compressed_tensors_checkpoint_matches_quantize_on_load(request, quant_model_dir, which, quantization):
    ct_dir = request.getfixturevalue(which)
    config = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    loaded, tokens = run(ct_dir)
    on_load, reference = run(quant_model_dir, quantization=quantization)
    assert loaded.stats()["quantization"] == quantization
    assert all(isinstance(getattr(layer, n), QuantizedLinear) for layer in loaded.engine.runner.model.layers
               for n in LAYER_LINEARS)
    for a, b in zip(packed_layers(loaded), packed_layers(on_load)):  # the same integers and scales
        assert torch.equal(a.words, b.words) and torch.equal(a.scales, b.scales)
    assert tokens == reference


def test_naive_quantized_and_group_int8_checkpoints_load(quant_model_dir, tmp_path):
    """int8 stored unpacked (naive-quantized), and llm-compressor's W8A16 preset (groups of 128)."""
    naive = compress(quant_model_dir, tmp_path / "naive", INT8_CHANNEL, "naive-quantized")
    assert json.loads((naive / "config.json").read_text())["quantization_config"]["format"] == "naive-quantized"
    _, reference = run(quant_model_dir, quantization="int8")
    assert run(naive)[1] == reference
    w8a16 = QuantizationScheme(targets=["Linear"], **preset_name_to_scheme("W8A16", ["Linear"])
                               .model_dump(exclude={"targets"}))
    grouped, tokens = run(compress(quant_model_dir, tmp_path / "w8a16", w8a16, "pack-quantized"))
    assert grouped.engine.runner.model.layers[0].qkv.group_size == 128
    _, dense = run(quant_model_dir)
    same = sum(a == b for r, o in zip(dense, tokens) for a, b in zip(r, o)) / sum(map(len, dense))
    assert same >= 0.9


def rewrite_config(src, dst, change):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_other_quantization_formats_are_refused_naming_them(ct_int8, tmp_path):
    gptq = rewrite_config(ct_int8, tmp_path / "gptq", lambda q: q.update(quant_method="gptq", format=None))
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        LLM(gptq, num_kv_blocks=16)

    def fp8(q):
        q["format"] = "float-quantized"
        q["config_groups"]["group_0"].update(format="float-quantized")
        q["config_groups"]["group_0"]["weights"].update(type="float")
    with pytest.raises(ValueError, match="format 'float-quantized' is not supported"):
        LLM(rewrite_config(ct_int8, tmp_path / "fp8", fp8), num_kv_blocks=16)

    def w8a8(q):
        q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                                              "dynamic": True, "symmetric": True}
    with pytest.raises(ValueError, match="activation quantization is not supported"):
        LLM(rewrite_config(ct_int8, tmp_path / "w8a8", w8a8), num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"already quantized \(int8, compressed-tensors\)"):
        LLM(ct_int8, quantization="int4", num_kv_blocks=16)
