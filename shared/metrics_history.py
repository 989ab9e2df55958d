"""A short memory for a service's Prometheus metrics: `/metrics?since=300` is the last 5 minutes.

Prometheus counters and histograms are totals since the process started; a Prometheus server
turns them into rates over a window, but `strata diagnose` must also work where none runs. So
each service snapshots its counters and histograms every `interval` seconds (an array of floats
per snapshot, about 5 KB for an engine; an hour by default) and answers `?since=S` with each
counter and histogram minus its value at the newest snapshot at least S seconds old (gauges as
they are now). The response's `Strata-Metrics-Window` header gives the window actually covered:
shorter than asked when the process or its memory is younger. Without `since`, /metrics is the
usual exposition.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

WINDOW_HEADER = "Strata-Metrics-Window"
_CUMULATIVE = ("counter", "histogram", "summary")


def _key(sample) -> tuple:
    return sample.name, tuple(sorted(sample.labels.items()))


class MetricsHistory:
    def __init__(self, registry: CollectorRegistry, interval: float = 10.0, keep: float = 3600.0,
                 clock=time.monotonic):
        self.registry, self.interval, self.clock = registry, interval, clock
        self.started = clock()
        self._index: dict[tuple, int] = {}  # sample -> its place in every snapshot
        self._snapshots: deque[tuple[float, array]] = deque(maxlen=max(int(keep / interval), 1))

    def _cumulative(self):
        for family in self.registry.collect():
            if family.type in _CUMULATIVE:
                for sample in family.samples:
                    if not sample.name.endswith("_created"):
                        yield sample

    def snapshot(self) -> None:
        values = array("d", bytes(8 * len(self._index)))
        for sample in self._cumulative():
            i = self._index.setdefault(_key(sample), len(self._index))
            if i >= len(values):
                values.extend([0.0] * (i + 1 - len(values)))
            values[i] = sample.value
        self._snapshots.append((self.clock(), values))

    async def run(self) -> None:
        while True:
            self.snapshot()
            await asyncio.sleep(self.interval)

    def exposition(self, since: float) -> tuple[bytes, float]:
        """(Prometheus text of the last `since` seconds, the window it covers); since <= 0: totals."""
        now = self.clock()
        base, base_time = None, self.started
        if since > 0:
            for t, values in reversed(self._snapshots):
                if t <= now - since:
                    base, base_time = values, t
                    break
        families = []
        for family in self.registry.collect():
            if base is not None and family.type in _CUMULATIVE:
                copy = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    i = self._index.get(_key(s))
                    old = base[i] if i is not None and i < len(base) and not s.name.endswith("_created") else 0.0
                    copy.add_sample(s.name, s.labels, s.value - old, s.timestamp, s.exemplar)
                family = copy
            families.append(family)
        return generate_latest(_Families(families)), now - base_time


class _Families:
    """A collector over already collected families (what generate_latest reads)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def metrics_response(request: web.Request, registry: CollectorRegistry, history: MetricsHistory) -> web.Response:
    """The /metrics handler's answer, with or without `?since=SECONDS`."""
    since = request.query.get("since")
    try:
        seconds = float(since) if since is not None else None
    except ValueError:
        raise web.HTTPBadRequest(text="since must be a number of seconds") from None
    if seconds is None:
        body, window = generate_latest(registry), history.clock() - history.started
    else:
        body, window = history.exposition(seconds)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST, WINDOW_HEADER: f"{window:.3f}"})
