"""Models of the shapes people deploy, built locally: random weights, a real tokenizer of the right size.

    S  the tiny model (shared/tiny_model.py): Llama, hidden 256, 4 layers, vocab 4096
    M  Llama, hidden 512, 8 layers, 8 heads / 4 KV heads, intermediate 1408, vocab 32,000 (56M parameters)
    L  the Qwen2.5-0.5B shape: Qwen2, hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864,
       vocab 151,936, tied embeddings, q/k/v biases (494M parameters)

The tokenizer is a byte-level BPE trained to exactly the configured vocabulary size. Large vocabularies
need more text than the repo's corpus, so the training text is `shared/data/corpus.txt` followed by the
source and documentation files of packages pinned in pyproject.toml (transformers, torch, numpy,
triton), read in sorted path order: the same text, hence the same tokenizer, wherever those pins are
installed. Its SHA-256 is recorded in `strata_model.json`. Trained tokenizers are cached under
STRATA_HOME/tokenizers; models under STRATA_HOME/models/<name>, built once (write to a temporary
directory, then rename, so a reader never sees half a model).

Weight scales follow the tiny model's, scaled by 1/sqrt(fan_in) so that activations have the same
size at every width: attention far from uniform, logits spread (std ~4), no near-ties under greedy.

    python -m shared.realistic_models M L          # build (or find) the M and L models, print their paths
    python -m shared.realistic_models M L --tokenizers DIR   # with tokenizers trained elsewhere
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

from shared import tiny_model
from shared.settings import default_home

# Packages whose files make the training text; each is pinned in pyproject.toml.
CORPUS_PACKAGES = ("transformers", "torch", "numpy", "triton")
CORPUS_SUFFIXES = (".py", ".pyi", ".h", ".hpp", ".cuh", ".md", ".rst", ".txt")
BUILDER_VERSION = 2  # bump when a change here changes what gets built

# Two families of special tokens and chat templates: Llama's (the tiny model's) and Qwen's ChatML.
LLAMA_SPECIALS = tiny_model.SPECIAL_TOKENS
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    name: str  # directory under STRATA_HOME/models
    architecture: str  # "llama" or "qwen2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0
    dtype: str = "bfloat16"  # what the checkpoint is saved in: bf16, as the models it stands for ship

    @property
    def chat_style(self) -> str:
        return "chatml" if self.architecture == "qwen2" else "llama"

    def num_params(self) -> int:
        h, head_dim = self.hidden_size, self.hidden_size // self.num_heads
        kv = self.num_kv_heads * head_dim
        attn = h * h * 2 + h * kv * 2 + ((h + 2 * kv) if self.architecture == "qwen2" else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embed + h


SHAPES: dict[str, ModelShape] = {
    # The tiny model itself (built by shared/tiny_model.py with its defaults).
    "S": ModelShape("tiny-llama", "llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=688, vocab_size=4096, max_position=2048, dtype="float32"),
    "M": ModelShape("bench-llama-m", "llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                    intermediate_size=1408, vocab_size=32000, max_position=4096),
    "L": ModelShape("bench-qwen2-l", "qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                    intermediate_size=4864, vocab_size=151936, max_position=32768, tie_embeddings=True,
                    rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def models_dir() -> Path:
    return default_home() / "models"


# ---------------------------------------------------------------- tokenizer


def corpus_files(packages: tuple[str, ...] = CORPUS_PACKAGES) -> Iterator[Path]:
    """The repo's corpus, then every matching file of each package in sorted order (packages that are
    not installed are left out, which changes the digest). Lazy: a capped read lists no more packages
    than it needs."""
    yield tiny_model.CORPUS
    for package in packages:
        spec = importlib.util.find_spec(package)  # locates without importing
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in sorted(spec.submodule_search_locations):
            root = Path(root)
            yield from sorted((p for p in root.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file()),
                              key=lambda p: p.relative_to(root).as_posix())


def read_corpus(max_bytes: int | None = None) -> tuple[list[str], str]:
    """The training text as one string per file, and its SHA-256 (over the bytes read, in order)."""
    texts, digest, total = [], hashlib.sha256(), 0
    for path in corpus_files():
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[:max_bytes - total]
        digest.update(data)
        texts.append(data.decode("utf-8", errors="replace"))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return texts, digest.hexdigest()


def tokenizer_file_name(style: str, vocab_size: int, digest: str) -> str:
    """How train_bpe names a trained tokenizer under STRATA_HOME/tokenizers (digest "*": any)."""
    return f"bpe-{style}-{vocab_size}-{digest}.json"


def train_bpe(vocab_size: int, style: str, max_corpus_bytes: int | None = None):
    """A byte-level BPE with exactly `vocab_size` tokens; returns (tokenizers.Tokenizer, corpus digest).

    Llama style: special tokens first and a BOS added to every prompt (as the tiny model). ChatML style
    (Qwen): special tokens last, no BOS. Cached by (vocab size, style, corpus digest)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = LLAMA_SPECIALS if style == "llama" else CHATML_SPECIALS
    texts, digest = read_corpus(max_corpus_bytes)
    cache = default_home() / "tokenizers" / tokenizer_file_name(style, vocab_size, digest[:16])
    if cache.exists():
        return Tokenizer.from_file(str(cache)), digest

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    learned = vocab_size if style == "llama" else vocab_size - len(specials)
    trainer = trainers.BpeTrainer(
        vocab_size=learned, special_tokens=specials if style == "llama" else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if style == "chatml":
        tokenizer.add_special_tokens(specials)
    else:
        bos = tokenizer.token_to_id(tiny_model.BOS)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tiny_model.BOS} $A", pair=f"{tiny_model.BOS} $A {tiny_model.BOS} $B",
            special_tokens=[(tiny_model.BOS, bos)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the training text ({sum(map(len, texts)):,} characters, digest {digest[:16]}) yields only "
            f"{tokenizer.get_vocab_size():,} tokens, not {vocab_size:,}: it needs more distinct text "
            f"(install the packages in CORPUS_PACKAGES: {', '.join(CORPUS_PACKAGES)})")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    tmp.replace(cache)
    return tokenizer, digest


def hf_tokenizer(tokenizer, style: str, max_position: int):
    """The transformers wrapper: special-token roles and a chat template, saved as tokenizer.json plus
    tokenizer_config.json (what AutoTokenizer and vLLM read)."""
    from transformers import PreTrainedTokenizerFast

    if style == "llama":
        return PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token=tiny_model.BOS, eos_token=tiny_model.EOS,
            pad_token=tiny_model.PAD, additional_special_tokens=LLAMA_SPECIALS[3:],
            chat_template=tiny_model.CHAT_TEMPLATE, model_max_length=max_position,
            clean_up_tokenization_spaces=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE,
        model_max_length=max_position, clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------- model


def _config(shape: ModelShape, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_position,
        rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=shape.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta}, dtype=shape.dtype,
    )
    if shape.architecture == "llama":
        return LlamaConfig(**common, bos_token_id=tokenizer.token_to_id(tiny_model.BOS),
                           eos_token_id=tokenizer.token_to_id(tiny_model.EOS),
                           pad_token_id=tokenizer.token_to_id(tiny_model.PAD), architectures=["LlamaForCausalLM"])
    if shape.architecture == "qwen2":
        end = tokenizer.token_to_id("<|endoftext|>")
        return Qwen2Config(**common, bos_token_id=end, eos_token_id=end, pad_token_id=end,
                           use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    raise ValueError(f"architecture {shape.architecture!r} not supported (llama, qwen2)")


def _fill_weights(model, shape: ModelShape) -> None:
    """Random weights, fixed by the seed, at the tiny model's scales relative to width (see the module
    docstring): matrices std c/sqrt(fan_in) with the tiny model's c at hidden 256, norms near 1."""
    import torch

    generator = torch.Generator().manual_seed(shape.seed)
    logit_std = 4.0  # the tiny model's: 0.25 * sqrt(256)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                value = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            elif name.endswith(".bias"):
                value = 0.1 * torch.randn(param.shape, generator=generator)
            elif name == "lm_head.weight" or (shape.tie_embeddings and "embed_tokens" in name):
                value = logit_std / math.sqrt(shape.hidden_size) * torch.randn(param.shape, generator=generator)
            elif "embed_tokens" in name:
                value = torch.randn(param.shape, generator=generator)
            else:
                c = 1.28 if ("q_proj" in name or "k_proj" in name) else 0.8  # 0.08 and 0.05 at fan_in 256
                value = c / math.sqrt(param.shape[1]) * torch.randn(param.shape, generator=generator)
            param.copy_(value)


def _manifest(shape: ModelShape, digest: str | None, max_corpus_bytes: int | None) -> dict:
    return {"kind": "realistic", "builder_version": BUILDER_VERSION, "shape": asdict(shape),
            "tokenizer_corpus_sha256": digest, "max_corpus_bytes": max_corpus_bytes}


def load_bpe(path: str | Path, vocab_size: int):
    """A tokenizer train_bpe saved (STRATA_HOME/tokenizers/bpe-*.json), carried to a machine where training
    it again would take long or see other package versions; returns (tokenizers.Tokenizer, file SHA-256)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"{path} has {tokenizer.get_vocab_size():,} tokens, not {vocab_size:,}")
    return tokenizer, hashlib.sha256(Path(path).read_bytes()).hexdigest()


def make_model(shape: ModelShape, out_dir: str | Path, max_corpus_bytes: int | None = None,
               tokenizer_file: str | Path | None = None) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to out_dir.
    The tokenizer is trained (train_bpe) unless `tokenizer_file` names one it saved."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    if tokenizer_file is not None:
        tokenizer, digest = load_bpe(tokenizer_file, shape.vocab_size)
    else:
        tokenizer, digest = train_bpe(shape.vocab_size, shape.chat_style, max_corpus_bytes)
    config = _config(shape, tokenizer)
    torch.manual_seed(shape.seed)  # transformers' own init runs first; the weights are ours below
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, shape)  # drawn in fp32 (the same values whatever the dtype), then stored in it
    model = model.to(getattr(torch, shape.dtype))
    if shape.chat_style == "chatml":
        model.generation_config.eos_token_id = [tokenizer.token_to_id("<|im_end|>"),
                                                tokenizer.token_to_id("<|endoftext|>")]
        model.generation_config.pad_token_id = tokenizer.token_to_id("<|endoftext|>")
    else:
        model.generation_config.eos_token_id = [tokenizer.token_to_id(tiny_model.EOS),
                                                tokenizer.token_to_id(tiny_model.END_OF_TURN)]
        model.generation_config.pad_token_id = tokenizer.token_to_id(tiny_model.PAD)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf_tokenizer(tokenizer, shape.chat_style, shape.max_position).save_pretrained(tmp)
        model.save_pretrained(tmp, max_shard_size="20GB")  # one file: model.safetensors
        manifest = _manifest(shape, None if tokenizer_file else digest, max_corpus_bytes)
        if tokenizer_file is not None:
            manifest["tokenizer_file_sha256"] = digest
        (tmp / "strata_model.json").write_text(json.dumps(manifest, indent=1))
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is for every reader
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_model(shape: str | ModelShape, out_dir: str | Path | None = None,
                 max_corpus_bytes: int | None = None, tokenizer_file: str | Path | None = None) -> Path:
    """The model directory for a shape ("S", "M", "L" or a ModelShape), built on first use; rebuilt when
    what is there was built from another shape or builder version."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")
        shape = SHAPES[shape]
    if shape == SHAPES["S"]:  # the tiny model, from its own builder
        return tiny_model.ensure_tiny_model(Path(out_dir) if out_dir else models_dir() / shape.name)
    out = Path(out_dir) if out_dir else models_dir() / shape.name
    manifest = out / "strata_model.json"
    if manifest.exists() and (out / "tokenizer.json").exists():
        built = json.loads(manifest.read_text())
        if built.get("builder_version") == BUILDER_VERSION and built.get("shape") == asdict(shape):
            return out
    return make_model(shape, out, max_corpus_bytes, tokenizer_file)


def scaled(shape: ModelShape, **changes) -> ModelShape:
    """A variant of a shape (tests: fewer layers, a smaller vocabulary), under its own name."""
    name = changes.pop("name", None) or shape.name + "-" + hashlib.sha256(
        json.dumps(changes, sort_keys=True).encode()).hexdigest()[:10]
    return replace(shape, name=name, **changes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES), help="shapes to build (or find)")
    parser.add_argument("--tokenizers", type=Path,
                        help="a folder of tokenizers train_bpe saved (its STRATA_HOME/tokenizers), used instead "
                             "of training them")
    args = parser.parse_args(argv)
    for key in args.shapes:
        tokenizer_file = None
        if args.tokenizers is not None and key != "S":
            shape = SHAPES[key]
            pattern = tokenizer_file_name(shape.chat_style, shape.vocab_size, "*")
            found = sorted(args.tokenizers.glob(pattern))
            if not found:
                parser.error(f"no {pattern} in {args.tokenizers}")
            tokenizer_file = found[0]
        path = ensure_model(key, tokenizer_file=tokenizer_file)
        print(f"{key} {path} ({SHAPES[key].num_params() / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
