"""An engine's cold start on realistic shapes: a fresh process imports the engine core, then builds
the offline LLM (tokenizer, weights, KV cache, warm-up); each phase timed, median of --repeats fresh
processes per shape. What a replica pays before it serves its first request.

    python bench/cold_start.py --shapes M,L --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_results  # noqa: E402
from shared.realistic_models import ensure_model  # noqa: E402

# Runs in the fresh process: the phases' seconds as one JSON line.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import services.engine.core_process
t1 = time.perf_counter()
from services.engine import LLM
LLM(sys.argv[1], num_threads=int(sys.argv[2]), num_kv_blocks=1024, max_num_seqs=16)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "total_s": t2 - t0,
                  "compressed_tensors_imported": "compressed_tensors" in sys.modules}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="M,L")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cold_start.json"))
    args = parser.parse_args()
    results = {}
    for key in args.shapes.split(","):
        model = ensure_model(key)
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(args.threads)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"{key}: the engine did not start:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in runs) for k in ("import_s", "build_s", "total_s")}
        results[key] = {"runs": runs, "median": med}
        print(f"{key}: import {med['import_s']:.2f} s, build {med['build_s']:.2f} s, total {med['total_s']:.2f} s "
              f"(median of {args.repeats}; compressed-tensors imported: {runs[0]['compressed_tensors_imported']})")
    write_results(args.out, args, {"shapes": results})


if __name__ == "__main__":
    main()
