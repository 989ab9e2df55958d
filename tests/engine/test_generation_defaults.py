"""generation_config.json fills a request's unset sampling fields (as vLLM does); an explicit
value always wins; the engine argument generation_config turns it off or points elsewhere."""

import json
import shutil

import pytest

from services.engine import LLM, SamplingParams
from services.engine.model_config import ModelConfig
from shared import protocol

PROMPTS = ["The queue holds", "A long time ago " * 12]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir, tmp_path_factory):
    """The tiny model whose generation config asks for greedy decoding and a repetition penalty."""
    path = tmp_path_factory.mktemp("gen") / "tiny-with-defaults"
    shutil.copytree(tiny_model_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, top_k=20, top_p=0.9, repetition_penalty=3.0, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def tokens(llm, **params):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True, **params))
    return [o.outputs[0].token_ids for o in outs]


def test_unset_fields_take_the_checkpoints_defaults(model_with_defaults, tiny_model_dir):
    defaults = ModelConfig.load(model_with_defaults).generation_defaults()
    assert defaults == {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 3.0}
    llm = LLM(model_with_defaults, num_kv_blocks=256)
    _, _, resolved = llm.engine.inputs.process("hi", SamplingParams(top_p=0.5))
    assert (resolved.temperature, resolved.top_p, resolved.top_k, resolved.min_p, resolved.repetition_penalty) == \
        (0.0, 0.5, 20, 0.0, 3.0)  # the explicit top_p wins; min_p is not in the file: built-in 0
    # Nothing set: greedy (with the file's penalty) where the built-in default samples.
    assert tokens(llm, seed=1) == tokens(llm, temperature=0.0, repetition_penalty=3.0)
    plain = LLM(tiny_model_dir, num_kv_blocks=256)
    assert tokens(plain, seed=1) != tokens(plain, temperature=0.0)


def test_explicit_values_win(model_with_defaults, tiny_model_dir):
    llm = LLM(model_with_defaults, num_kv_blocks=256)
    plain = LLM(tiny_model_dir, num_kv_blocks=256)
    explicit = dict(temperature=0.9, top_k=-1, top_p=1.0, repetition_penalty=1.0, seed=7)
    assert tokens(llm, **explicit) == tokens(plain, **explicit)


def test_the_engine_argument_turns_defaults_off_or_reads_another_folder(model_with_defaults, tiny_model_dir):
    off = LLM(model_with_defaults, num_kv_blocks=256, generation_config="vllm")
    _, _, resolved = off.engine.inputs.process("hi", SamplingParams())
    assert (resolved.temperature, resolved.top_k, resolved.repetition_penalty) == (1.0, -1, 1.0)
    elsewhere = LLM(tiny_model_dir, num_kv_blocks=256, generation_config=str(model_with_defaults))
    assert elsewhere.engine.inputs.generation_defaults["repetition_penalty"] == 3.0
    with pytest.raises(ValueError, match="generation_config"):
        LLM(tiny_model_dir, num_kv_blocks=256, generation_config="/nonexistent")


def test_the_wire_leaves_unset_fields_unset():
    spec = protocol.SamplingParams(max_tokens=8)
    decoded = protocol.SamplingParams.from_dict(spec.to_dict())
    assert (decoded.temperature, decoded.top_p, decoded.top_k, decoded.min_p, decoded.repetition_penalty) == (None,) * 5
    assert "temperature" not in spec.to_dict()
