"""What the logits processors (logit_bias, allowed_token_ids, bad_words, min_tokens) cost one
sampling step, side by side in one run: `Sampler.prepare` + `Sampler.sample` on bf16 logits for a
batch whose rows have none, one row with each, and every row with each, greedy and sampled
(t0.8 p0.95 k50). The ratio is to the same batch without processors. Best of --repeats.

    python bench/logits_processors.py [--threads 1] [--shapes 151936x64,32000x32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import torch  # noqa: E402

from bench.common import write_results  # noqa: E402
from bench.sampler import best_ms, make_seqs  # noqa: E402
from services.engine.logits_processors import ResolvedProcessors  # noqa: E402
from services.engine.sampler import Sampler  # noqa: E402
from services.engine.sampling_params import SamplingParams  # noqa: E402

BASES = {"greedy": dict(temperature=0.0), "sampled (t0.8 p0.95 k50)": dict(temperature=0.8, top_p=0.95, top_k=50)}


def processors(vocab: int) -> dict[str, tuple[dict, ResolvedProcessors | None]]:
    """Each processor as the sampler reads it: SamplingParams fields, and what the engine
    resolves from them onto the Sequence (logits_processors.resolve)."""
    rng = random.Random(1)
    return {
        "logit_bias (16 ids)": (dict(logit_bias={rng.randrange(vocab): 5.0 for _ in range(16)}), None),
        "allowed_token_ids (256)": (dict(allowed_token_ids=rng.sample(range(vocab), 256)), None),
        "bad_words (8 two-token words)": (dict(bad_words=["w"]), ResolvedProcessors(
            [[rng.randrange(vocab), rng.randrange(vocab)] for _ in range(8)], [])),
        "min_tokens (2 EOS ids)": (dict(min_tokens=1000, max_tokens=2000), ResolvedProcessors([], [1, 2])),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="151936x64,32000x32", help="VOCABxROWS,...")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/logits_processors.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for shape in args.shapes.split(","):
        vocab, rows = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        logits = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
        sampler = Sampler(vocab)
        print(f"\n-- vocab {vocab:,}, {rows} rows, {args.threads} thread(s): ms per step (ratio to none)")
        print(f"  {'base':26s} {'processor':32s} {'none':>7s} {'one row':>15s} {'every row':>15s}")
        for base_name, base in BASES.items():
            plain = SamplingParams(**base).resolved()
            seqs = make_seqs(plain, rows, vocab)
            none = best_ms(lambda x: sampler.sample(x, sampler.prepare(seqs)), args.repeats, logits.clone)
            for name, (fields, resolved) in processors(vocab).items():
                with_params = msgspec.structs.replace(plain, **fields)
                timings = {}
                for label, count in (("one", 1), ("every", rows)):
                    for i, seq in enumerate(seqs):
                        seq.params, seq.processors = (with_params, resolved) if i < count else (plain, None)
                    timings[label] = best_ms(lambda x: sampler.sample(x, sampler.prepare(seqs)), args.repeats, logits.clone)
                for seq in seqs:
                    seq.params, seq.processors = plain, None
                print(f"  {base_name:26s} {name:32s} {none:7.2f} {timings['one']:7.2f} ({timings['one'] / none:4.2f}x)"
                      f" {timings['every']:7.2f} ({timings['every'] / none:4.2f}x)")
                results.append({"vocab": vocab, "rows": rows, "base": base_name, "processor": name, "none_ms": none,
                                "one_row_ms": timings["one"], "every_row_ms": timings["every"]})
    write_results(args.out, args, {"rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
