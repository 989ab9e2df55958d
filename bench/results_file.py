"""Where benchmark figures go: one JSON per script under bench/results/, with its config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_results(path: str | Path, args: argparse.Namespace, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": vars(args), **data}, indent=2))
    print(f"wrote {path}")
