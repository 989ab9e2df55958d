"""Build the tiny Llama that everything here runs on: offline, deterministic, a few M parameters.

The tokenizer is a byte-level BPE trained on `shared/data/corpus.txt` (shipped in the repo); the
weights are random but fixed by the seed. Weight scales are chosen so that attention is far
from uniform (positions matter) and logits are spread (greedy decoding rarely meets near-ties),
which makes token-exact comparisons with transformers meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "corpus.txt"

BOS, EOS, PAD, END_OF_TURN = "<s>", "</s>", "<pad>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, END_OF_TURN, "<|system|>", "<|user|>", "<|assistant|>"]
# Tools are rendered as Hermes / Qwen2.5 templates do (a system turn listing them, calls in
# <tool_call> tags), so the `hermes` tool call parser reads this model's calls; without tools
# the template renders exactly as it did before tools existed.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\nYou may call one or more functions. "
    "Function signatures:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "For each call, return a JSON object with the function name and arguments within <tool_call></tool_call> "
    "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|end|>\n"
    "{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{% for call in message.get('tool_calls') or [] %}<tool_call>\n"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": {{ call['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    # Paragraph-sized pieces; BPE training is deterministic for a fixed input order.
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def make_tiny_model(
    out_dir: str | Path,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 4096,
    intermediate: int | None = None,
    max_position: int = 2048,
    seed: int = 0,
    tie_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config to out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(vocab)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE,
        model_max_length=max_position, clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out)

    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate or (hidden * 8 // 3 + 15) // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-5,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        tie_word_embeddings=tie_embeddings,
        rope_parameters=rope,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                std = 0.08 if ("q_proj" in name or "k_proj" in name) else 0.05
                if name == "lm_head.weight" or (tie_embeddings and "embed_tokens" in name):
                    std = 0.25  # spread logits: std ~ 0.25 * sqrt(hidden)
                elif "embed_tokens" in name:
                    std = 1.0
                param.copy_(std * torch.randn(param.shape, generator=generator))
    model.generation_config.eos_token_id = [tok.token_to_id(EOS), tok.token_to_id(END_OF_TURN)]
    model.generation_config.pad_token_id = tok.token_to_id(PAD)
    model.save_pretrained(out, safe_serialization=True)
    (out / "strata_model.json").write_text(json.dumps({"kind": "tiny-llama", "seed": seed}))
    return out


def ensure_tiny_model(out_dir: str | Path, **kwargs) -> Path:
    """Build the tiny model once; later calls reuse the directory."""
    out = Path(out_dir)
    if not (out / "model.safetensors").exists() or not (out / "tokenizer.json").exists():
        make_tiny_model(out, **kwargs)
    return out
