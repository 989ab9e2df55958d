"""The sampler alone at real vocabularies: one step's sampling for a batch of rows.

For each vocabulary and batch (default: 151,936 x 64 rows, the Qwen2.5 vocabulary, and 32,000 x 32)
and each sampling setting, the time of `Sampler.prepare` + `Sampler.sample` on bf16 logits (the
model's dtype), side by side with a reference sampler that does what Strata's sampler did before
issue 16: logits copied to the host in fp32, the whole vocabulary sorted per row, a softmax and one
`torch.multinomial` draw per row with its own generator; with the general path (the same sampler
with its fused CPU kernel off: the candidates and whole-row draws in C, the rest as torch ops);
and with the torch path (no C at all: what other devices run, here on the CPU). Rows carry 300
prompt and 100 output tokens, so penalties have counts to gather. Best of --repeats, after a
warm-up.

    python bench/sampler.py [--threads 1] [--shapes 151936x64,32000x32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_results  # noqa: E402
from services.engine.sampler import Sampler  # noqa: E402
from services.engine.sampling_params import SamplingParams  # noqa: E402
from services.engine.sequence import Sequence  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "bench (t0.8 p0.95 k50 rep1.1)": dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1),
    "bench, seeded": dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=1),
    "presence+frequency": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5),
    "greedy + 5 logprobs": dict(temperature=0.0, logprobs=5),
}


def make_seqs(params: SamplingParams, rows: int, vocab: int) -> list[Sequence]:
    rng = random.Random(0)
    seqs = []
    for i in range(rows):
        seq = Sequence(f"r{i}", [rng.randrange(vocab) for _ in range(300)], params)
        seq.token_ids.extend(rng.randrange(vocab) for _ in range(100))
        seqs.append(seq)
    return seqs


def reference_sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The pre-issue-16 way: host fp32 copy, per-row penalties, full sort, one draw per row."""
    host = logits.float().cpu()
    out = []
    for row, seq in enumerate(seqs):
        p = seq.params
        x = host[row]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)))
            v = x[seen]
            x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            counts = torch.bincount(torch.tensor(seq.token_ids[seq.num_prompt_tokens:]), minlength=x.numel())
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logprobs is not None:
            torch.log_softmax(x, dim=-1).topk(max(p.logprobs, 1))
        if p.greedy:
            out.append(int(x.argmax()))
            continue
        values, order = torch.sort(x / p.temperature, descending=True)
        if p.top_k and p.top_k > 0:
            values[p.top_k:] = float("-inf")
        probs = torch.softmax(values, dim=-1)
        if p.top_p < 1.0:
            drop = probs.cumsum(0) - probs > p.top_p
            probs[drop] = 0
        gen = torch.Generator().manual_seed(p.seed if p.seed is not None else row)
        out.append(int(order[torch.multinomial(probs, 1, generator=gen)]))
    return out


def best_ms(fn, repeats: int, setup=None) -> float:
    """Best time of fn() over the repeats; with a setup, of fn(setup()), the setup untimed."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        args = () if setup is None else (setup(),)
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="151936x64,32000x32", help="VOCABxROWS,...")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true", help="skip the slow reference sampler")
    ap.add_argument("--out", default="bench/results/sampler.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows_out = []
    for shape in args.shapes.split(","):
        vocab, rows = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        logits = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
        sampler, general, torch_path = Sampler(vocab), Sampler(vocab, fused=False), Sampler(vocab)
        torch_path.use_c_kernels = False
        print(f"\n-- vocab {vocab:,}, {rows} rows, {args.threads} thread(s): ms per step")
        print(f"  {'setting':32s} {'strata':>9s} {'general':>9s} {'torch':>9s} {'reference':>10s} {'speed-up':>9s}")
        for name, cfg in SETTINGS.items():
            seqs = make_seqs(SamplingParams(**cfg).resolved(), rows, vocab)
            # sample() may write its logits (penalties mask the seen ids): a fresh copy each time, untimed
            strata = best_ms(lambda x: sampler.sample(x, sampler.prepare(seqs)), args.repeats, logits.clone)
            general_ms = best_ms(lambda x: general.sample(x, general.prepare(seqs)), args.repeats, logits.clone)
            torch_ms = best_ms(lambda x: torch_path.sample(x, torch_path.prepare(seqs)), args.repeats, logits.clone)
            ref = None if args.no_reference else best_ms(lambda: reference_sample(logits, seqs),
                                                         max(1, args.repeats // 2))
            ratio = f"{ref / strata:8.1f}x" if ref else "-"
            print(f"  {name:32s} {strata:9.2f} {general_ms:9.2f} {torch_ms:9.2f} "
                  f"{ref if ref else float('nan'):10.1f} {ratio:>9s}")
            rows_out.append({"vocab": vocab, "rows": rows, "setting": name, "strata_ms": strata,
                             "general_path_ms": general_ms, "torch_path_ms": torch_ms, "reference_ms": ref})
    write_results(args.out, args, {"rows": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
