"""A model that copies its prompt: a built model's shape, vocabulary and dtype, with weights set so
that greedy decoding continues a span of the context the way an LLM copies text it was given.

The realistic models (shared.realistic_models) have random weights: their output repeats no
span of the prompt and no smaller model predicts it, so speculative decoding accepts nothing on
them. To measure speculation on an editing workload the target must copy, and a draft model
must agree with it most of the time, as real ones do. This builder keeps everything that sets a
model's cost per token (the shape, every matrix at its size, the vocabulary, the dtype) and
writes weights that implement an induction circuit (Olsson et al., 2022) in its first two
layers; the later layers are kept at their size with zero output projections.

    embedding  [u(x) | 0 | 0 | 0 | 1]: a random code u(x) of each token and a constant
    layer 0    previous-token heads (rotary position only): the codes of the two tokens before
               each position, P u(x[t-1]) and P u(x[t-2]), into two blocks of the residual
    layer 1    induction heads: position t attends to the earlier positions j whose two
               previous tokens are x[t-1], x[t] (content in the low-frequency rotary pairs), and
               copies the code R u(x[j]) of the token there into the output block
    head       logit(y) = alpha * R u(y) . output block: the token that followed the same two
               tokens earlier in the context

Where the two tokens before t occurred several times with different continuations, the heads
average them and noise decides, so a copy jumps or stops where real copying is ambiguous too. A
model built at another width with another seed (a draft) copies the same spans and disagrees at
different places. rope_theta is set to 1e8 (the rotary frequencies the circuit needs: high
ones for position, near-static ones for content); a tied embedding is untied (the engine holds a
packed copy of the head either way). Both leave the cost per token as it was.

    python -m shared.copying_model BASE_DIR OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                "special_tokens_map.json")
BUILDER_VERSION = 1
ROPE_THETA = 1e8
POSITION_PAIRS = 6  # rotary pairs 0..5 (the fastest) locate the previous tokens
CONTENT_FIRST_PAIR = 16  # pairs from here on turn by < 0.5 rad over 4096 positions: content matching
POSITION_SHARPNESS = 17.0  # score per position pair: a margin of ~12 logits over the neighbours
MATCH_SCORE = 24.0  # a two-token match scores ~24, a one-token match ~12, others 0 (noise std ~4)
READOUT = 0.5  # the copied token's logit leads by ~15


def make_copying_model(base_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the copying variant of the model at base_dir to out_dir (rebuilt only when the base or
    the builder changed); returns out_dir."""
    import torch
    from safetensors.torch import load_file, save_file

    base, out = Path(base_dir), Path(out_dir)
    base_manifest = (base / "strata_model.json").read_text() if (base / "strata_model.json").exists() else ""
    manifest = {"kind": "copying", "builder_version": BUILDER_VERSION, "base": str(base), "seed": seed,
                "base_manifest_sha256": hashlib.sha256(base_manifest.encode()).hexdigest()}
    if (out / "strata_model.json").exists() and json.loads((out / "strata_model.json").read_text()) == manifest:
        return out
    config = json.loads((base / "config.json").read_text())
    shards = sorted(base.glob("*.safetensors"))
    if len(shards) != 1:
        raise ValueError(f"{base}: expected one model.safetensors, found {len(shards)} shards")
    tensors = load_file(str(shards[0]))
    dtype = tensors["model.embed_tokens.weight"].dtype
    for name, value in _circuit(config, seed).items():
        if name not in tensors and name != "lm_head.weight":  # a tied head gets its own tensor
            raise KeyError(f"{base}: no tensor {name}")
        tensors[name] = value.to(dtype).contiguous()
    for name in list(tensors):  # the later layers: their size kept, their output zero
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= 2 and (
                name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    config["tie_word_embeddings"] = False
    config.setdefault("rope_parameters", {"rope_type": "default"})["rope_theta"] = ROPE_THETA
    config.pop("rope_theta", None)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in COPIED_FILES:
            if (base / name).exists():
                shutil.copy(base / name, tmp / name)
        (tmp / "strata_model.json").write_text(json.dumps(manifest, indent=1))
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _circuit(config: dict, seed: int) -> dict:
    """The weights of the embedding, layers 0 and 1, the final norm and the head (fp32)."""
    import torch

    d, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or d // heads
    group = heads // kv_heads
    half = kv_heads // 2  # kv groups per previous-token block
    if half < 1 or head_dim % 2 or head_dim // 2 <= CONTENT_FIRST_PAIR:
        raise ValueError("a copying model needs at least 2 KV heads and head_dim > 32")
    block = half * head_dim  # one previous-token block
    d_main = d - 1 - 2 * block - head_dim
    if d_main < 16:
        raise ValueError(f"hidden size {d} too small for the circuit ({2 * block + head_dim + 17} needed)")
    prev1, prev2, out, const = d_main, d_main + block, d_main + 2 * block, d - 1
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731

    w: dict[str, torch.Tensor] = {}
    codes = randn(vocab, d_main)
    embed = torch.zeros(vocab, d)
    beta = math.sqrt(d_main)
    embed[:, :d_main], embed[:, const] = codes, beta
    w["model.embed_tokens.weight"] = embed

    theta = ROPE_THETA ** (-torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim)
    content = [i for p in range(CONTENT_FIRST_PAIR, head_dim // 2) for i in (p, p + head_dim // 2)]
    proj_prev = randn(block, d_main) / math.sqrt(d_main)  # P
    proj_out = randn(head_dim, d_main) / math.sqrt(d_main)  # R

    def layer(i: int, q, k, v, o) -> None:
        p = f"model.layers.{i}"
        for name, value in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)):
            w[f"{p}.self_attn.{name}.weight"] = value
            if config.get("model_type") == "qwen2":
                w[f"{p}.self_attn.{name}.bias"] = torch.zeros(value.shape[0]) if name != "o_proj" else None
        w[f"{p}.mlp.down_proj.weight"] = torch.zeros(d, config["intermediate_size"])
        w[f"{p}.input_layernorm.weight"] = torch.ones(d)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(d)

    # Layer 0: after RMSNorm the residual is scaled by c0; the heads read the constant for position
    # and the token code for their values.
    c0 = math.sqrt(d / (d_main + beta ** 2))
    amp = math.sqrt(POSITION_SHARPNESS * math.sqrt(head_dim))
    q0, k0 = torch.zeros(heads * head_dim, d), torch.zeros(kv_heads * head_dim, d)
    v0, o0 = torch.zeros(kv_heads * head_dim, d), torch.zeros(d, heads * head_dim)
    for kv in range(2 * half):
        offset = 1 if kv < half else 2
        rows = slice(kv * head_dim, (kv + 1) * head_dim)
        for pair in range(POSITION_PAIRS):
            angle = float(offset * theta[pair])
            k0[kv * head_dim + pair, const] = amp * math.cos(angle) / (beta * c0)
            k0[kv * head_dim + head_dim // 2 + pair, const] = amp * math.sin(angle) / (beta * c0)
        v0[rows, :d_main] = proj_prev[(kv % half) * head_dim:(kv % half + 1) * head_dim] / c0
        dest = (prev1 if kv < half else prev2) + (kv % half) * head_dim
        for h in range(kv * group, (kv + 1) * group):
            for pair in range(POSITION_PAIRS):
                q0[h * head_dim + pair, const] = amp / (beta * c0)
            o0[dest:dest + head_dim, h * head_dim:(h + 1) * head_dim] = torch.eye(head_dim) / group
    layer(0, q0, k0, v0, o0)

    # Layer 1: keys hold the two previous tokens' codes, queries the current and previous ones.
    c1 = math.sqrt(d / (d_main + 2 * block + beta ** 2))
    q1, k1 = torch.zeros(heads * head_dim, d), torch.zeros(kv_heads * head_dim, d)
    v1, o1 = torch.zeros(kv_heads * head_dim, d), torch.zeros(d, heads * head_dim)
    scale = math.sqrt(MATCH_SCORE * math.sqrt(head_dim) / (2 * len(content)))
    for kv in range(kv_heads):
        m_now, m_before = randn(len(content), block) / math.sqrt(block), randn(len(content), block) / math.sqrt(block)
        rows = [kv * head_dim + i for i in content]
        k1[rows, prev1:prev1 + block] = scale * m_now / c1
        k1[rows, prev2:prev2 + block] = scale * m_before / c1
        v1[kv * head_dim:(kv + 1) * head_dim, :d_main] = proj_out / c1
        for h in range(kv * group, (kv + 1) * group):
            hrows = [h * head_dim + i for i in content]
            q1[hrows, :d_main] = scale * (m_now @ proj_prev) / c1
            q1[hrows, prev1:prev1 + block] = scale * m_before / c1
            o1[out:out + head_dim, h * head_dim:(h + 1) * head_dim] = torch.eye(head_dim) / heads
    layer(1, q1, k1, v1, o1)

    # The head reads the output block (the final norm scales the residual by c2).
    c2 = math.sqrt(d / (d_main + 2 * block + head_dim + beta ** 2))
    w["model.norm.weight"] = torch.ones(d)
    head = torch.zeros(vocab, d)
    head[:, out:out + head_dim] = READOUT * (codes @ proj_out.T) / c2
    w["lm_head.weight"] = head
    return {k: v for k, v in w.items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(make_copying_model(a.base_dir, a.out_dir, seed=a.seed))


if __name__ == "__main__":
    main()
