"""Request traces for the fleet simulator: synthetic generators (steady, diurnal, bursty), each
seeded, and trace files (CSV or JSONL with arrival_s, prompt_tokens, output_tokens).

Arrivals are a Poisson process whose rate is given per second: each second draws its count,
and its arrivals fall uniformly inside it, so a day of hundreds of requests a second is a few
vectorised numpy calls rather than millions of Python steps.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DAY_S = 86400.0
GENERATORS = ("steady", "diurnal", "bursty")


@dataclass
class RequestSizes:
    """Prompt and output lengths: log-normal (long tails, as chat and reasoning traffic has),
    clipped to what one replica can hold."""

    prompt_median: float = 1500.0
    prompt_sigma: float = 0.8
    prompt_max: int = 16000
    output_median: float = 800.0
    output_sigma: float = 0.7
    output_max: int = 4096

    def mean_prompt(self) -> float:
        return self.prompt_median * math.exp(self.prompt_sigma ** 2 / 2)

    def mean_output(self) -> float:
        return self.output_median * math.exp(self.output_sigma ** 2 / 2)

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        prompt = rng.lognormal(math.log(self.prompt_median), self.prompt_sigma, n)
        output = rng.lognormal(math.log(self.output_median), self.output_sigma, n)
        return (np.clip(prompt, 16, self.prompt_max).astype(np.int64),
                np.clip(output, 16, self.output_max).astype(np.int64))


@dataclass
class Trace:
    name: str
    arrival_s: np.ndarray  # sorted, seconds from the start
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    duration_s: float

    def __len__(self) -> int:
        return len(self.arrival_s)


def poisson_arrivals(rate_per_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times of a Poisson process whose rate in second i is rate_per_s[i]."""
    counts = rng.poisson(rate_per_s)
    starts = np.repeat(np.arange(len(rate_per_s), dtype=np.float64), counts)
    return np.sort(starts + rng.random(len(starts)))


def steady_rate(peak_rate: float, duration_s: float) -> np.ndarray:
    return np.full(math.ceil(duration_s), float(peak_rate))


def diurnal_rate(peak_rate: float, duration_s: float, trough: float = 0.2) -> np.ndarray:
    """A sinusoid over 24 hours: `trough` x peak at midnight (t=0), the peak at noon."""
    t = np.arange(math.ceil(duration_s), dtype=np.float64)
    return peak_rate * (trough + (1 - trough) * (1 - np.cos(2 * math.pi * t / DAY_S)) / 2)


def bursty_rate(peak_rate: float, duration_s: float, rng: np.random.Generator, bursts_per_hour: float = 1.0,
                multiplier: tuple[float, float] = (2.0, 5.0), burst_s: tuple[float, float] = (120.0, 900.0),
                ramp_s: tuple[float, float] = (30.0, 120.0)) -> np.ndarray:
    """A flat base with random bursts of several times the base lasting minutes. Each burst
    ramps up, holds and ramps down (trapezoid); overlapping bursts take the larger. The largest
    burst reaches exactly multiplier[1] x base = peak_rate, so the peak is known in advance."""
    n_s = math.ceil(duration_s)
    t = np.arange(n_s, dtype=np.float64)
    base = peak_rate / multiplier[1]
    n = max(1, rng.poisson(bursts_per_hour * duration_s / 3600))
    starts = rng.uniform(0, max(duration_s - burst_s[0], 1.0), n)
    lengths = rng.uniform(*burst_s, n)
    ramps = rng.uniform(*ramp_s, n)
    mults = rng.uniform(*multiplier, n)
    mults[np.argmax(mults)] = multiplier[1]
    factor = np.ones(n_s)
    for start, length, ramp, mult in zip(starts, lengths, ramps, mults):
        ramp = min(ramp, length / 2)
        shape = np.clip(np.minimum(t - start, start + length - t) / ramp, 0.0, 1.0)
        factor = np.maximum(factor, 1 + (mult - 1) * shape)
    return base * factor


def generate(kind: str, peak_rate: float, duration_s: float = DAY_S, seed: int = 0,
             sizes: RequestSizes | None = None) -> Trace:
    """A synthetic trace peaking at `peak_rate` requests per second."""
    rng = np.random.default_rng(seed)
    if kind == "steady":
        rate = steady_rate(peak_rate, duration_s)
    elif kind == "diurnal":
        rate = diurnal_rate(peak_rate, duration_s)
    elif kind == "bursty":
        rate = bursty_rate(peak_rate, duration_s, rng)
    else:
        raise ValueError(f"unknown trace {kind!r} (one of {', '.join(GENERATORS)}, or a file)")
    arrivals = poisson_arrivals(rate, rng)
    arrivals = arrivals[arrivals < duration_s]
    prompt, output = (sizes or RequestSizes()).draw(rng, len(arrivals))
    return Trace(kind, arrivals, prompt, output, float(duration_s))


def load(path: str | Path, duration_s: float | None = None) -> Trace:
    """A trace file: CSV with a header, or JSONL, each row arrival_s, prompt_tokens, output_tokens
    (rows in any order; arrivals at or after duration_s are dropped when it is given)."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    with path.open() as f:
        if path.suffix in (".jsonl", ".json", ".ndjson"):
            records = (json.loads(line) for line in f if line.strip())
        else:
            records = csv.DictReader(f)
        for n, rec in enumerate(records, start=1):
            try:
                rows.append((float(rec["arrival_s"]), int(rec["prompt_tokens"]), int(rec["output_tokens"])))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: record {n} needs arrival_s, prompt_tokens, output_tokens ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    data = np.array(sorted(rows), dtype=np.float64)
    arrivals = data[:, 0]
    if duration_s is not None:
        data = data[arrivals < duration_s]
        arrivals = data[:, 0]
    end = duration_s if duration_s is not None else math.floor(arrivals[-1]) + 1.0
    return Trace(path.stem, arrivals.copy(), np.maximum(data[:, 1], 1).astype(np.int64),
                 np.maximum(data[:, 2], 1).astype(np.int64), float(end))
