"""Speculative decoding on the M and L shapes (bf16): decode tokens/s with n-gram and draft-model
speculation vs none, at batch 1 and batch 32, in one run.

Models (STRATA_HOME/models, built once):
  target   the shape's checkpoint (shared/realistic_models.py) rebuilt to copy its prompt
           (shared/copying_model.py: the same shape, vocabulary and dtype, so the same cost per
           token; an induction circuit in its first two layers)
  draft    a 2-layer, hidden-256 model over the same vocabulary and tokenizer (the realistic
           builder at that width), rebuilt to copy the same way with another seed: it copies the
           same spans and slips at other places
  random   the shape's checkpoint as built (random weights): on M no draft is ever right, and the
           adaptive policy must then cost (almost) nothing; L ties its embeddings, so its random
           weights repeat the last token and every draft is right there
Workload "copy": each prompt is an instruction, a document (README and docs/*.md of this repo,
windows of it) and the document's first words again; the target's output goes on repeating the
document, as in an editing task. Greedy, ignore_eos.

Arms, each an engine of its own in this process, run interleaved (every arm in turn, --repeats
times; medians): none; ngram (k=4, prompt_lookup 2..4) and draft_model (k=4), adaptive (the
engine default: k per step from the measured cost model); at batch 32 also with the k fixed
(`"adaptive": false`), to show what the cost model saves. Batch 1 measures decode tokens/s:
(output tokens - 1) / (time - time to the first token); batch 32 the throughput of the whole
batch (output tokens / wall time, prefill included, as a server sees it). Every arm's greedy
output is compared with the plain engine's (token-identical expected on the copying models; on
the random ones bf16 rounding, which depends on the rows per matmul, flips near-tied argmaxes, so
there the first differing token is set beside the one where plain decoding in a batch of two
differs from decoding alone). Acceptance rates (accepted / draft tokens), acceptance per
position and the k the policy chose come from the engine's stats.

Targets (issue 20): n-gram >= 1.8x at batch 1 on the copy workload; >= 0.95x at batch 32.
GPU figures: not measured (no GPU on this machine).

    python bench/spec_decode.py                      # M and L (about 25 minutes on 2 busy cores)
    python bench/spec_decode.py --shapes M --repeats 1 --batch1-tokens 128 --batch32-tokens 32
Writes bench/results/spec_decode.json (after each shape) and bench/results/spec_decode.png.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import pyplot, write_results  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.llm_engine import load_tokenizer  # noqa: E402
from shared.copying_model import make_copying_model  # noqa: E402
from shared.realistic_models import SHAPES, ensure_model, models_dir, scaled  # noqa: E402

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
TARGET_NGRAM_BATCH1 = 1.8
TARGET_BATCH32 = 0.95
INSTRUCTION = "Copy-edit the document below and give it back in full.\n\n"


def build_models(key: str) -> dict[str, Path]:
    shape = SHAPES[key]
    base = ensure_model(key)
    draft_shape = scaled(shape, name=f"{shape.name}-draft", hidden_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, intermediate_size=688, seed=1)
    draft_base = ensure_model(draft_shape)
    return {"random": base,
            "random_draft": draft_base,
            "target": make_copying_model(base, models_dir() / f"{shape.name}-copying", seed=0),
            "draft": make_copying_model(draft_base, models_dir() / f"{draft_shape.name}-copying", seed=1)}


def documents() -> str:
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def copy_prompts(model_dir: Path, n: int, document_tokens: int) -> list[list[int]]:
    """n prompts, each: the instruction, a window of document_tokens tokens of the documents
    (windows far apart), a blank line and the window's first 8 tokens again."""
    tok = load_tokenizer(model_dir)
    ids = tok.encode(documents(), add_special_tokens=False)
    head = tok.encode(INSTRUCTION, add_special_tokens=True)
    step = max((len(ids) - document_tokens) // max(n, 1), 1)
    prompts = []
    for i in range(n):
        window = ids[(i * step) % max(len(ids) - document_tokens, 1):][:document_tokens]
        prompts.append(head + window + tok.encode("\n\n", add_special_tokens=False) + window[:8])
    return prompts


SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, batch1: bool) -> dict:
    before = llm.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"seconds": seconds, "output_tokens": tokens, "outputs": [o.outputs[0].token_ids for o in outs]}
    if batch1:
        m = outs[0].metrics
        ttft = m.first_token_time - m.arrival_time
        result["ttft_s"] = ttft
        result["tokens_per_s"] = (tokens - 1) / (seconds - ttft)
    else:
        result["tokens_per_s"] = tokens / seconds
    if "spec_decode_num_drafts" in after:
        delta = {k: after[k] - before[k] for k in SPEC_KEYS}
        per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                         before["spec_decode_num_accepted_tokens_per_pos"])]
        steps = {int(k): v - before["spec_decode_steps_by_k"].get(k, 0)
                 for k, v in after["spec_decode_steps_by_k"].items()}
        result.update(
            draft_tokens=delta["spec_decode_num_draft_tokens"],
            accepted_tokens=delta["spec_decode_num_accepted_tokens"],
            acceptance_rate=(delta["spec_decode_num_accepted_tokens"] / delta["spec_decode_num_draft_tokens"]
                             if delta["spec_decode_num_draft_tokens"] else 0.0),
            acceptance_per_position=[p / delta["spec_decode_num_drafts"] if delta["spec_decode_num_drafts"] else 0.0
                                     for p in per_pos],
            steps_by_k={k: v for k, v in sorted(steps.items()) if v})
    result["steps"] = after["num_steps"] - before["num_steps"]
    return result


def first_difference(outputs: list[list[int]], reference: list[list[int]]) -> int | None:
    """The first output position (over all prompts) where outputs and reference differ, or None."""
    found = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None if len(o) == len(r) else min(len(o), len(r)))
             for o, r in zip(outputs, reference)]
    return min((i for i in found if i is not None), default=None)


def batch_variance(llm: LLM, prompts: list[list[int]], other: list[int], max_tokens: int) -> int | None:
    """Where plain greedy decoding of prompts[0] in a batch of two first differs from it alone:
    bf16 matmuls round differently with another number of rows, and on near-tied logits (random
    weights) that flips an argmax. Speculation verifies 1 + k rows per sequence, so it can differ
    from plain decoding there as batching does; the copying models' logits have clear leaders."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    alone = llm.generate(prompts[:1], params)[0].outputs[0].token_ids
    crowd = llm.generate([prompts[0], other], params)[0].outputs[0].token_ids
    return first_difference([crowd], [alone])


def set_adaptive(llm: LLM, adaptive: bool) -> None:
    """The same engine with its k fixed or chosen per step (its cost model keeps what it measured)."""
    llm.engine.spec.policy.adaptive = adaptive


def interleave(arms: dict[str, tuple[LLM, bool | None]], prompts, max_tokens: int, repeats: int,
               batch1: bool) -> dict[str, dict]:
    """Every arm in turn, `repeats` times; per arm the median tokens/s and the runs."""
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(repeats):
        for name, (llm, adaptive) in arms.items():
            if adaptive is not None:
                set_adaptive(llm, adaptive)
            res = run(llm, prompts, max_tokens, batch1)
            runs[name].append(res)
            extra = (f", acceptance {res['acceptance_rate']:.2f}, k chosen {res['steps_by_k']}"
                     if "acceptance_rate" in res else "")
            print(f"  [{r + 1}/{repeats}] {name:>13}: {res['tokens_per_s']:8.1f} tok/s ({res['steps']} steps{extra})",
                  flush=True)
    plain = runs["none"][0]["outputs"]
    summary = {}
    for name, rs in runs.items():
        keep = {k: v for k, v in rs[-1].items() if k != "outputs"}
        summary[name] = {**keep, "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                         "runs_tokens_per_s": [x["tokens_per_s"] for x in rs],
                         "greedy_identical": all(x["outputs"] == plain for x in rs),
                         "first_difference": min((d for x in rs if (d := first_difference(x["outputs"], plain))
                                                  is not None), default=None)}
        if "acceptance_rate" in rs[0]:
            summary[name]["acceptance_rate"] = statistics.median(x["acceptance_rate"] for x in rs)
    for name in summary:
        summary[name]["speedup"] = summary[name]["tokens_per_s"] / summary["none"]["tokens_per_s"]
    return summary


def engines(target: Path, draft: Path, max_num_seqs: int, num_kv_blocks: int) -> dict[str, LLM]:
    common = dict(max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False)
    return {"none": LLM(target, **common),
            "ngram": LLM(target, speculative_config=NGRAM, **common),
            "draft_model": LLM(target, speculative_config={"method": "draft_model", "model": str(draft),
                                                           "num_speculative_tokens": K}, **common)}


def warm(llms: dict[str, LLM], prompt: list[int]) -> None:
    for llm in llms.values():
        llm.generate([prompt[:64]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


def bench_shape(key: str, a: argparse.Namespace) -> dict:
    paths = build_models(key)
    doc_tokens = a.document_tokens[key]
    prompts1 = copy_prompts(paths["target"], 1, doc_tokens)
    prompts32 = copy_prompts(paths["target"], 32, a.batch32_document_tokens[key])
    blocks = 32 * -(-(a.batch32_document_tokens[key] + 40 + a.batch32_tokens + K + 2) // 16) + 64
    out: dict = {"shape": key, "params": SHAPES[key].num_params(), "vocab": SHAPES[key].vocab_size,
                 "models": {k: str(v) for k, v in paths.items()},
                 "prompt_tokens": {"batch1": len(prompts1[0]), "batch32": [len(p) for p in prompts32]}}

    print(f"{key}: copy workload, target {paths['target'].name}, draft {paths['draft'].name}", flush=True)
    llms = engines(paths["target"], paths["draft"], 32, blocks)
    warm(llms, prompts1[0])
    arms1 = {name: (llm, True if name != "none" else None) for name, llm in llms.items()}
    print(f" batch 1, {a.batch1_tokens} tokens, prompt {len(prompts1[0])} tokens", flush=True)
    out["copy_batch1"] = interleave(arms1, prompts1, a.batch1_tokens, a.repeats, batch1=True)
    arms32 = {**arms1, "ngram_fixed_k": (llms["ngram"], False), "draft_fixed_k": (llms["draft_model"], False)}
    print(f" batch 32, {a.batch32_tokens} tokens each", flush=True)
    out["copy_batch32"] = interleave(arms32, prompts32, a.batch32_tokens, a.repeats, batch1=False)
    del llms, arms1, arms32
    gc.collect()

    print(f"{key}: the random checkpoint (no draft is ever right), batch 1", flush=True)
    llms = engines(paths["random"], paths["random_draft"], 4, blocks)
    warm(llms, prompts1[0])
    out["random_batch1"] = interleave({n: (llm, True if n != "none" else None) for n, llm in llms.items()},
                                      prompts1, a.batch1_tokens, a.repeats, batch1=True)
    out["random_batch1"]["none"]["batch_of_two_first_difference"] = batch_variance(
        llms["none"], prompts1, prompts32[0], a.batch1_tokens)
    del llms
    gc.collect()
    return out


def report(res: dict) -> None:
    key = res["shape"]
    for part, label in (("copy_batch1", "batch 1, copy"), ("copy_batch32", "batch 32, copy"),
                        ("random_batch1", "batch 1, random weights")):
        for name, r in res[part].items():
            acc = f"  acceptance {r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
            same = "" if r["greedy_identical"] else f"  greedy output differs from token {r['first_difference']}"
            if "batch_of_two_first_difference" in r:
                same += f"  (plain, in a batch of two: differs from token {r['batch_of_two_first_difference']})"
            print(f"{key} {label:>24} {name:>13}: {r['tokens_per_s']:8.1f} tok/s  {r['speedup']:.2f}x{acc}{same}")
    ngram1 = res["copy_batch1"]["ngram"]["speedup"]
    worst32 = min(r["speedup"] for n, r in res["copy_batch32"].items() if n in ("ngram", "draft_model"))
    print(f"{key} targets: n-gram batch 1 {ngram1:.2f}x (>= {TARGET_NGRAM_BATCH1}x: "
          f"{'met' if ngram1 >= TARGET_NGRAM_BATCH1 else 'NOT met'}); batch 32 adaptive worst {worst32:.2f}x "
          f"(>= {TARGET_BATCH32}x: {'met' if worst32 >= TARGET_BATCH32 else 'NOT met'})")


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    parts = (("copy_batch1", "batch 1, copy workload"), ("copy_batch32", "batch 32, copy workload"),
             ("random_batch1", "batch 1, random weights"))
    fig, axes = plt.subplots(len(results), len(parts), figsize=(16, 4.2 * len(results)), squeeze=False)
    colors = {"none": "#7f7f7f", "ngram": "#1f77b4", "draft_model": "#2ca02c", "ngram_fixed_k": "#aec7e8",
              "draft_fixed_k": "#98df8a"}
    for row, (key, res) in enumerate(results.items()):
        for col, (part, label) in enumerate(parts):
            ax = axes[row][col]
            arms = res[part]
            names = list(arms)
            bars = ax.bar(names, [arms[n]["speedup"] for n in names], color=[colors[n] for n in names])
            ax.bar_label(bars, labels=[f"{arms[n]['speedup']:.2f}x" + (f"\nacc {arms[n]['acceptance_rate']:.2f}"
                                                                        if "acceptance_rate" in arms[n] else "")
                                       for n in names], fontsize=7)
            ax.axhline(1.0, color="black", linewidth=0.8)
            if part == "copy_batch1":
                ax.axhline(TARGET_NGRAM_BATCH1, color="#1f77b4", linewidth=0.8, linestyle=":")
            if part == "copy_batch32":
                ax.axhline(TARGET_BATCH32, color="#d62728", linewidth=0.8, linestyle=":")
            ax.set_ylabel("tokens/s vs none")
            ax.set_title(f"{key} ({res['params'] / 1e6:.0f}M, vocab {res['vocab']:,}): {label}\n"
                         f"none = {arms['none']['tokens_per_s']:.1f} tok/s", fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
            ax.set_ylim(0, max(max(arms[n]["speedup"] for n in names) * 1.25, 1.3))
    fig.suptitle("Speculative decoding (bf16, CPU, k=4): adaptive unless 'fixed_k'; dotted: issue 20's targets",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def per_shape(text: str, cast=int) -> dict[str, int]:
    """'M=600,L=400' or one value for every shape."""
    if "=" not in text:
        return {k: cast(text) for k in SHAPES}
    return {k: cast(v) for k, v in (part.split("=") for part in text.split(","))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="M,L")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch1-tokens", type=int, default=256)
    parser.add_argument("--batch32-tokens", type=int, default=96)
    parser.add_argument("--document-tokens", type=per_shape, default=per_shape("M=700,L=700"))
    parser.add_argument("--batch32-document-tokens", type=per_shape, default=per_shape("M=240,L=160"))
    parser.add_argument("--out", default=str(ROOT / "bench/results/spec_decode.json"))
    a = parser.parse_args()
    results = {}
    for key in a.shapes.split(","):
        results[key] = bench_shape(key, a)
        report(results[key])
        write_results(a.out, a, {"gpu": "not measured (no GPU on this machine)", "shapes": results})
    for res in results.values():
        report(res)
    plot(results, Path(a.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
