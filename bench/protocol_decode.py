"""The wire protocol's encode and decode, old (the hand-written checker over msgpack) against new
(msgspec Structs with a cached typed decoder per class), side by side in one run: a GenerateRequest
with a 32k-token prompt (decoded by the scheduler and again by the engine), one engine step's
TokenChunkBatch of 32 chunks (one per gateway per step) and a lone TokenChunk (the per-request
path). The old protocol is shared/protocol.py at --old-ref, loaded as a module of its own. Each
arm runs --loops encode+decode rounds per repeat, the arms interleaved; best and median of
--repeats. It also checks each version reads the other's bytes (the wire stays compatible).

    python bench/protocol_decode.py [--old-ref 59e6560] [--repeats 15] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_results  # noqa: E402
from shared import protocol as new  # noqa: E402

OLD_REF = "59e6560"  # main before the msgspec protocol: the hand-written decoder


def load_old(ref: str):
    source = subprocess.run(["git", "show", f"{ref}:shared/protocol.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("protocol_at_" + ref.replace("/", "_"), loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses resolve their annotations through it)
    exec(compile(source, f"{ref}:shared/protocol.py", "exec"), module.__dict__)
    return module


def generate_request(p, tokens: int):
    rng = random.Random(0)
    sampling_params = getattr(p, "SamplingParams", None) or p.SamplingSpec  # (its name at --old-ref)
    return p.GenerateRequest(
        request_id="r-" + "7" * 30, model="bench-llama-m", reply_to="_INBOX.gateway.gw.abcdef.r1",
        prompt_token_ids=[rng.randrange(151_936) for _ in range(tokens)],
        sampling=sampling_params(max_tokens=256, temperature=0.7, top_p=0.95, seed=1234, stop=["\n\n"]),
        deadline=1.8e9, tenant="bench", priority="standard",
        timestamps={"gateway_arrival": 1.8e9, "gateway_sent": 1.8e9 + 0.001, "scheduler_received": 1.8e9 + 0.002},
        region="local", batch_to="_GW.gw.batches")


def chunk(p, i: int):
    return p.TokenChunk(request_id=f"req-{i:04d}-" + "a" * 24, seq=17, token_ids=[1000 + i], text=" word",
                        replica_id="engine-0")


def token_chunk_batch(p, chunks: int):
    return p.TokenChunkBatch(replica_id="engine-0", chunks=[chunk(p, i) for i in range(chunks)])


def round_trip(p, msg, cls, loops: int) -> tuple[float, float]:
    """Seconds per encode and per decode, `loops` of each."""
    start = time.perf_counter()
    for _ in range(loops):
        data = p.encode(msg)
    encoded = time.perf_counter()
    for _ in range(loops):
        p.decode(cls, data)
    return (encoded - start) / loops, (time.perf_counter() - encoded) / loops


def same(a, b) -> bool:
    return a.to_dict() == b.to_dict()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-ref", default=OLD_REF, help="the git ref of the old shared/protocol.py")
    ap.add_argument("--tokens", type=int, default=32_768, help="prompt tokens of the GenerateRequest")
    ap.add_argument("--chunks", type=int, default=32, help="chunks of the TokenChunkBatch")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench/results/protocol_decode.json")
    args = ap.parse_args(argv)
    old = load_old(args.old_ref)
    cases = {  # name: (build(protocol module), class name, loops per repeat)
        f"GenerateRequest ({args.tokens:,} prompt tokens)": (lambda p: generate_request(p, args.tokens),
                                                             "GenerateRequest", 20),
        f"TokenChunkBatch ({args.chunks} chunks)": (lambda p: token_chunk_batch(p, args.chunks), "TokenChunkBatch", 400),
        "TokenChunk (one, per request)": (lambda p: chunk(p, 0), "TokenChunk", 4000),
    }
    results = {}
    print(f"old: shared/protocol.py at {args.old_ref}; new: this tree (msgspec). Best of {args.repeats} "
          f"(median in brackets), microseconds per message")
    print(f"  {'message':38s} {'arm':4s} {'bytes':>8s} {'encode':>16s} {'decode':>16s} {'enc+dec':>16s}")
    for name, (build, cls_name, loops) in cases.items():
        arms = {"old": (old, build(old), getattr(old, cls_name)), "new": (new, build(new), getattr(new, cls_name))}
        # Compatibility: each reads the other's bytes as the same message.
        (_, old_msg, old_cls), (_, new_msg, new_cls) = arms["old"], arms["new"]
        compatible = (same(new.decode(new_cls, old.encode(old_msg)), new_msg)
                      and same(old.decode(old_cls, new.encode(new_msg)), old_msg))
        timings: dict[str, dict[str, list[float]]] = {arm: {"encode": [], "decode": []} for arm in arms}
        for _ in range(args.repeats):
            for arm, (p, msg, cls) in arms.items():  # interleaved: the same noise for both
                enc, dec = round_trip(p, msg, cls, loops)
                timings[arm]["encode"].append(enc)
                timings[arm]["decode"].append(dec)
        row = {"compatible": compatible}
        for arm, (p, msg, cls) in arms.items():
            t = timings[arm]
            both = [e + d for e, d in zip(t["encode"], t["decode"])]
            row[arm] = {"bytes": len(p.encode(msg)),
                        **{f"{k}_us_best": min(v) * 1e6 for k, v in (*t.items(), ("enc_dec", both))},
                        **{f"{k}_us_median": statistics.median(v) * 1e6 for k, v in (*t.items(), ("enc_dec", both))}}
            r = row[arm]
            print(f"  {name:38s} {arm:4s} {r['bytes']:>8,d} "
                  + " ".join(f"{r[k + '_us_best']:>8.1f} ({r[k + '_us_median']:>6.1f})" for k in ("encode", "decode", "enc_dec")))
        row["speedup_best"] = {k: row["old"][f"{k}_us_best"] / row["new"][f"{k}_us_best"]
                               for k in ("encode", "decode", "enc_dec")}
        row["speedup_median"] = {k: row["old"][f"{k}_us_median"] / row["new"][f"{k}_us_median"]
                                 for k in ("encode", "decode", "enc_dec")}
        s = row["speedup_median"]
        print(f"  {'':38s} old/new (median): encode {s['encode']:.1f}x, decode {s['decode']:.1f}x, "
              f"encode+decode {s['enc_dec']:.1f}x; each reads the other's bytes: {'yes' if compatible else 'NO'}")
        results[name] = row
    write_results(args.out, args, {"python": sys.version.split()[0], "cases": results})
    return 0 if all(r["compatible"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
