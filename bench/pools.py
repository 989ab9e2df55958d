"""The capacity pools figure: `strata simulate` on the bursty trace at 1,000 replicas (a day of
traffic) over the three pools of bench/pools.yaml, whose cheapest loses 90% of its capacity for
two hours at the peak: the pooled policy against the single-pool policy and an oracle. Writes
bench/results/pools.json and pools.png; further options go on to the simulator
(docs/simulator.md).

    python bench/pools.py [--seed 1] [--jobs 3]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.scaler.simulator import main

if __name__ == "__main__":
    os.chdir(ROOT)  # the report names the files as the repository sees them
    sys.exit(main(["bursty", "--replicas-max", "1000", "--pools", "bench/pools.yaml", "--out", "bench/results",
                   *sys.argv[1:]]))
