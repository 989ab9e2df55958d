"""Engine throughput: Strata vs Hugging Face `generate` on the same model and workload.

Workload: N requests, prompt lengths uniform in [16, 512], output lengths uniform in [16, 256],
ignore_eos (every request generates exactly its length). Three runs, side by side:
  strata      all requests at once through the offline LLM API (continuous batching)
  hf-static   transformers generate in static batches of max_num_seqs (left padding; a batch
              runs until its longest request is done: only the tokens each request asked for count)
  hf-single   transformers generate one request at a time
Prints output tokens/s for each and the ratios; writes bench/results/engine_throughput.json.

    python bench/engine_throughput.py [--requests 128] [--max-num-seqs 32] [--hf-single-requests 32]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.common import write_results  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(8, vocab) for _ in range(rng.randint(16, 512))], rng.randint(16, 256)) for _ in range(n)]


def run_strata(model_dir, reqs, max_num_seqs: int) -> dict:
    llm = LLM(model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(m for _, m in reqs)
    stats = llm.stats()
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "steps": stats["num_steps"], "preemptions": stats["num_preemptions"],
            "host_prepare_s": stats["step_prepare_s"], "forward_s": stats["step_forward_s"],
            "sample_s": stats["step_sample_s"]}


@torch.inference_mode()
def run_hf_static(model, reqs, batch_size: int, pad_id: int) -> dict:
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, _) in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(m for _, m in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=pad_id)
        useful += sum(m for _, m in batch)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": useful, "tokens_per_s": useful / elapsed}


@torch.inference_mode()
def run_hf_single(model, reqs, pad_id: int) -> dict:
    start = time.perf_counter()
    tokens = 0
    for p, m in reqs:
        ids = torch.tensor([p])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                       do_sample=False, pad_token_id=pad_id)
        tokens += m
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed, "requests": len(reqs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="model directory (default: the tiny model)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="Strata's batch size and HF's static batch")
    parser.add_argument("--hf-single-requests", type=int, default=32,
                        help="requests for the one-at-a-time run (a prefix of the workload; its rate is what counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_throughput.json"))
    args = parser.parse_args()

    model_dir = Path(args.model) if args.model else ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    reqs = workload(args.requests, hf.config.vocab_size, args.seed)
    print(f"model {model_dir} ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M params), "
          f"{len(reqs)} requests, torch threads {torch.get_num_threads()}", flush=True)

    results = {"strata": run_strata(model_dir, reqs, args.max_num_seqs)}
    print(f"strata     {results['strata']['tokens_per_s']:8.1f} tok/s", flush=True)
    results["hf_static"] = run_hf_static(hf, reqs, args.max_num_seqs, pad_id=0)
    print(f"hf-static  {results['hf_static']['tokens_per_s']:8.1f} tok/s", flush=True)
    results["hf_single"] = run_hf_single(hf, reqs[:args.hf_single_requests], pad_id=0)
    print(f"hf-single  {results['hf_single']['tokens_per_s']:8.1f} tok/s "
          f"({results['hf_single']['requests']} requests)", flush=True)
    ratios = {"vs_hf_static": results["strata"]["tokens_per_s"] / results["hf_static"]["tokens_per_s"],
              "vs_hf_single": results["strata"]["tokens_per_s"] / results["hf_single"]["tokens_per_s"]}
    print(f"ratio strata / hf-static: {ratios['vs_hf_static']:.2f}x (target >= 2)")
    print(f"ratio strata / hf-single: {ratios['vs_hf_single']:.2f}x (target >= 10)")
    write_results(args.out, args, {"results": results, "ratios": ratios})


if __name__ == "__main__":
    main()
