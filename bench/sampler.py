"""The sampler alone at real vocabularies: one step's sampling for a batch of rows.

For each vocabulary and batch (default: 151,936 x 64 rows, the Qwen2.5 vocabulary, and 32,000 x 32)
and each sampling setting, the time of `Sampler.prepare` + `Sampler.sample` on bf16 logits (the
model's dtype), side by side with a reference sampler that does what Strata's sampler did before
issue 16: logits copied to the host in fp32, the whole vocabulary sorted per row, a softmax and one
`torch.multinomial` draw per row with its own generator; with the general path (the same sampler
with its fused CPU kernel off: the candidates and whole-row draws in C, the rest as torch ops);
and with the torch path (no C at all: what other devices run, here on the CPU). With --device
cuda: the device path with its draws as torch ops and as the Triton kernels (kernels/sampling.py,
the default there), the logits on the GPU. Rows carry 300 prompt and 100 output tokens, so
penalties have counts to gather. Best of --repeats, after a warm-up.

--launches counts instead the kernels one `sample` launches on the device path, torch ops against
the Triton kernels (on CPU tensors, the kernels through TRITON_INTERPRET=1): on a GPU each launch
is host time while the GPU waits, a few microseconds each.

    python bench/sampler.py [--threads 1] [--shapes 151936x64,32000x32] [--repeats 5] [--device cpu]
    python bench/sampler.py --launches [--shapes 20000x8] --out bench/results/sampler_launches.json
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

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


class KernelLaunches(TorchDispatchMode):
    """Counts the kernels launched inside it: dispatched torch ops less views and bare allocations,
    and calls of kernels.sampling's launchers (run with the mode off, so that the interpreter's own
    ops are not counted)."""

    NOT_KERNELS = {"view", "slice", "alias", "select", "resolve_conj", "resolve_neg", "expand", "as_strided",
                   "unsqueeze", "squeeze", "empty", "detach", "t", "transpose", "split", "split_with_sizes"}
    LAUNCHERS = ("log_sum_exp", "penalized_values", "sample_candidates", "sample_whole_rows")

    def __init__(self):
        super().__init__()
        self.torch_ops: collections.Counter = collections.Counter()
        self.triton: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).split(".")[1]
        if name not in self.NOT_KERNELS:
            self.torch_ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from kernels import sampling
        self._launchers = {name: getattr(sampling, name) for name in self.LAUNCHERS}
        for name, launch in self._launchers.items():
            setattr(sampling, name, self._counted(name, launch))
        return super().__enter__()

    def __exit__(self, *exc):
        from kernels import sampling
        for name, launch in self._launchers.items():
            setattr(sampling, name, launch)
        return super().__exit__(*exc)

    def _counted(self, name, launch):
        def counted(*args, **kwargs):
            self.triton[name] += 1
            with _disable_current_modes():
                return launch(*args, **kwargs)
        return counted

    @property
    def total(self) -> int:
        return sum(self.torch_ops.values()) + sum(self.triton.values())


def count_launches(vocab: int, rows: int, seqs: list[Sequence], triton: bool, device: str = "cpu") -> KernelLaunches:
    """The kernels one `sample` launches on the device path (no C kernels) for these rows."""
    sampler = Sampler(vocab, device)
    sampler.use_c_kernels, sampler.use_triton_kernels = False, triton
    batch = sampler.prepare(seqs)
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    with KernelLaunches() as launches:
        sampler.sample(logits.to(device), batch)
    return launches


def launches_main(args) -> int:
    rows_out = []
    for shape in args.shapes.split(","):
        vocab, rows = (int(v) for v in shape.split("x"))
        print(f"\n-- vocab {vocab:,}, {rows} rows: kernels launched by one sample (device path)")
        print(f"  {'setting':32s} {'torch ops':>10s} {'triton':>7s}  (torch + triton)")
        for name, cfg in SETTINGS.items():
            seqs = make_seqs(SamplingParams(**cfg).resolved(), rows, vocab)
            ops, kernels = (count_launches(vocab, rows, seqs, triton, args.device) for triton in (False, True))
            print(f"  {name:32s} {ops.total:10d} {kernels.total:7d}  "
                  f"({sum(kernels.torch_ops.values())} + {sum(kernels.triton.values())})")
            rows_out.append({"vocab": vocab, "rows": rows, "setting": name, "torch_ops_launches": ops.total,
                             "triton_launches": kernels.total, "triton_path_torch_ops": dict(kernels.torch_ops),
                             "triton_path_kernels": dict(kernels.triton)})
    write_results(args.out, args, {"rows": rows_out})
    return 0


def samplers(vocab: int, device: str) -> dict[str, Sampler]:
    """The arms compared on this device, by the JSON key of their time."""
    if device == "cpu":
        arms = {"strata_ms": Sampler(vocab), "general_path_ms": Sampler(vocab, fused=False),
                "torch_path_ms": Sampler(vocab)}
        arms["torch_path_ms"].use_c_kernels = False
        return arms
    arms = {"torch_ops_ms": Sampler(vocab, device), "triton_ms": Sampler(vocab, device)}
    arms["torch_ops_ms"].use_triton_kernels = False
    return arms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="151936x64,32000x32", help="VOCABxROWS,...")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true", help="skip the slow reference sampler")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: torch ops against the Triton kernels")
    ap.add_argument("--launches", action="store_true", help="count kernel launches instead of timing")
    ap.add_argument("--out", default="bench/results/sampler.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.launches:
        if args.device == "cpu":  # before triton is first imported (kernels.sampling imports it on first use)
            os.environ["TRITON_INTERPRET"] = "1"
        return launches_main(args)
    rows_out = []
    for shape in args.shapes.split(","):
        vocab, rows = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        logits = (torch.randn(rows, vocab) * 3).to(torch.bfloat16).to(args.device)
        arms = samplers(vocab, args.device)
        print(f"\n-- vocab {vocab:,}, {rows} rows, {args.device}, {args.threads} thread(s): ms per step")
        print(f"  {'setting':32s} " + " ".join(f"{key[:-3]:>11s}" for key in arms) + f" {'reference':>10s} "
              f"{'speed-up':>9s}")
        for name, cfg in SETTINGS.items():
            seqs = make_seqs(SamplingParams(**cfg).resolved(), rows, vocab)
            # sample() may write its logits (penalties mask the seen ids): a fresh copy each time,
            # untimed; the step ends with its tokens on the host, so no device work is left out.
            times = {key: best_ms(lambda x, s=s: s.sample(x, s.prepare(seqs)), args.repeats, logits.clone)
                     for key, s in arms.items()}
            ref = None if args.no_reference else best_ms(lambda: reference_sample(logits, seqs),
                                                         max(1, args.repeats // 2))
            first = next(iter(times.values()))
            ratio = f"{ref / first:8.1f}x" if ref else "-"
            print(f"  {name:32s} " + " ".join(f"{ms:11.2f}" for ms in times.values()) +
                  f" {ref if ref else float('nan'):10.1f} {ratio:>9s}")
            rows_out.append({"vocab": vocab, "rows": rows, "device": args.device, "setting": name, **times,
                             "reference_ms": ref})
    write_results(args.out, args, {"rows": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
