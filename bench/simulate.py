"""The issue's simulator figure: `strata simulate` on the bursty trace at 1,000 replicas (a day of
traffic), policy against the oracle and fixed provisioning. Writes bench/results/simulate.json
and simulate.png; further options go on to the simulator (see docs/simulator.md).

    python bench/simulate.py [--seed 1] [--jobs 3]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.scaler.simulator import main

if __name__ == "__main__":
    os.chdir(ROOT)  # the report names the output directory as the repository sees it
    sys.exit(main(["bursty", "--replicas-max", "1000", "--out", "bench/results", *sys.argv[1:]]))
