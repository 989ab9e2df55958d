"""The canary analysis at work: control judges each canary that has a `canary.analysis` and
moves it through its steps, promotes it or rolls it back by itself, recording why.

Every tick (a second) it reads the deployments; for one whose canary revision has an analysis it
judges the current step's window once every `interval_s` (services.control.canary, pure), and
acts through the store, only if the canary and its weight are still the ones it judged. The
verdict, its figures and the reason go into the deployment's history (`analysis` on the event,
actor `canary-analysis`); the run itself (steps, the latest verdict, every decided one) is kept
under strata:deployment:<name>:analysis for `strata canary status` and the dashboard.

The samples are the gateways' (GatewayStats.samples/outcomes, fed to `on_gateway_stats`) and
live in this process: a restarted control starts the current step's window afresh. A weight set
by hand stops the analysis (status `manual`): the operator has taken over.
"""

from __future__ import annotations

import asyncio
import json
import string
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.control.canary import AnalysisConfig, SampleBook, Verdict, analysis_from_spec, judge, next_action
from services.control.store import DeploymentError, DeploymentStore
from shared import deployments, keys
from shared.deployments import DeploymentState
from shared.logging import get_logger
from shared.protocol import GatewayStats

log = get_logger()
ACTOR = "canary-analysis"
SETTLE_S = 1.0  # after a weight change, time for every scheduler to apply it before the window opens
MAX_KEPT_VERDICTS = 50


@dataclass
class AnalysisRun:
    """One canary's analysis, as stored and shown."""

    deployment: str
    canary: int
    stable: int
    steps: list[int]
    step_index: int
    status: str = "running"  # running | promoted | rolled_back | manual | ended
    reason: str = ""
    started_at: float = 0.0
    step_started_at: float = 0.0
    updated_at: float = 0.0
    judged_at: float = 0.0
    config: dict = field(default_factory=dict)
    last: dict | None = None  # the latest verdict, a waiting one included
    verdicts: list[dict] = field(default_factory=list)  # every decided step, oldest first

    @property
    def step(self) -> int:
        return self.steps[self.step_index] if 0 <= self.step_index < len(self.steps) else 0

    def to_dict(self) -> dict:
        """As the API shows it: the stored fields and the current step's weight."""
        return {**asdict(self), "step": self.step}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> "AnalysisRun":
        return cls(**json.loads(raw))


async def read_run(redis, name: str) -> AnalysisRun | None:
    raw = await redis.get(keys.deployment_analysis(name))
    return AnalysisRun.from_json(raw) if raw else None


async def prometheus_value(http: aiohttp.ClientSession, url: str, query: str) -> float:
    """The largest value an instant query returns (ValueError when it returns nothing usable)."""
    async with http.get(f"{url}/api/v1/query", params={"query": query}) as resp:
        body = await resp.json(content_type=None)
    if body.get("status") != "success":
        raise ValueError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    data = body["data"]
    if data["resultType"] == "scalar":
        values = [float(data["result"][1])]
    elif data["resultType"] == "vector":
        values = [float(r["value"][1]) for r in data["result"]]
    else:
        raise ValueError(f"the query returns a {data['resultType']}, not a number")
    if not values:
        raise ValueError("the query returns no series")
    return max(values)


class CanaryDriver:
    def __init__(self, redis, store: DeploymentStore, announce: Callable[[str, str, DeploymentState], Awaitable[None]],
                 registry: CollectorRegistry, tick_s: float = 1.0, clock=time.time):
        self.redis, self.store, self.announce = redis, store, announce
        self.tick_s, self.clock = tick_s, clock
        self.book = SampleBook()
        self.runs: dict[str, AnalysisRun] = {}
        self.decisions = Counter("strata:control_canary_decisions",
                                 "Canary analysis decisions: step (to the next weight), promote, rollback.",
                                 ["deployment", "decision"], registry=registry)
        self.weight = Gauge("strata:control_canary_weight_percent", "The canary revision's share of traffic.",
                            ["deployment"], registry=registry)
        self._weighted: set[str] = set()  # deployments with a weight gauge
        self._lock = asyncio.Lock()  # the loop's ticks and refresh() after a change: one at a time
        self._http: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    def on_gateway_stats(self, report: GatewayStats) -> None:
        self.book.add(report)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._http is not None:
            await self._http.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # Redis away, a bug: the next tick tries again
                log.exception("canary analysis tick failed")
            await asyncio.sleep(self.tick_s)

    async def tick(self) -> None:
        async with self._lock:
            await self._tick(self.clock())

    async def _tick(self, now: float) -> None:
        live: set[tuple[str, int]] = set()
        weighted = set()
        for name in await deployments.list_names(self.redis):
            state = await deployments.read_state(self.redis, name)
            if state is None:
                continue
            live |= {(name, rev) for rev in (state.stable, state.canary) if rev}
            self.weight.labels(name).set(state.canary_weight if state.canary else 0)
            weighted.add(name)
            await self._analyse(name, state, now)
        for name in set(self.runs) - weighted:
            self.runs.pop(name)  # deleted
        for name in self._weighted - weighted:
            self.weight.remove(name)
        self._weighted = weighted
        self.book.prune(now, keep=live)

    async def refresh(self, name: str) -> None:
        """Look at one deployment now (control calls it after a change: an analysis starts at once)."""
        async with self._lock:
            state = await deployments.read_state(self.redis, name)
            if state is not None:
                await self._analyse(name, state, self.clock())

    async def _analyse(self, name: str, state: DeploymentState, now: float) -> None:
        run = self.runs.get(name)
        if run is not None and run.canary != state.canary:
            if run.status == "running":  # the canary was promoted, rolled back or replaced by hand
                await self._finish(run, "ended", "the canary was promoted, rolled back or replaced by hand", now)
            self.runs.pop(name)
            run = None
        if not state.canary:
            return
        spec = await deployments.read_spec(self.redis, name, state.canary)
        config = analysis_from_spec(spec.canary) if spec is not None else None
        if config is None:
            return
        if run is None:
            run = self.runs[name] = await self._begin(name, state, config, now)
        if run.status != "running":
            return
        if state.canary_weight != run.step:
            await self._finish(run, "manual", f"the canary's weight was set to {state.canary_weight}% by hand: the "
                                              f"analysis stopped (promote or roll back by hand)", now)
            return
        if now - run.judged_at < config.interval_s:
            return
        run.judged_at = now
        verdict = await self._judge(name, state, run, config, now)
        run.last, run.updated_at = verdict.to_dict(), now
        action = next_action(config, run.step_index, verdict)
        if action is None:
            await self._save(run)
            return
        kind = {"set_weight": "canary", "promote": "promote", "rollback": "rollback"}[action.kind]
        try:
            after = await self.store.analysis_step(name, state.canary, run.step, kind, action.weight,
                                                   {**verdict.to_dict(), "action": kind, "to_weight": action.weight,
                                                    "canary_revision": state.canary, "stable_revision": state.stable},
                                                   actor=ACTOR)
        except DeploymentError as exc:  # changed meanwhile: the next tick sees the new state
            log.info("canary analysis action skipped", deployment=name, reason=str(exc))
            return
        await self.announce(name, kind, after)
        self.decisions.labels(name, {"canary": "step"}.get(kind, kind)).inc()
        run.verdicts = (run.verdicts + [verdict.to_dict()])[-MAX_KEPT_VERDICTS:]
        log.info("canary analysis decided", deployment=name, revision=state.canary, step=run.step,
                 decision=verdict.decision, action=kind, weight=action.weight, reason=verdict.reason)
        if kind == "canary":
            run.step_index += 1
            run.step_started_at = now + SETTLE_S
            await self._save(run)
        else:
            await self._finish(run, "promoted" if kind == "promote" else "rolled_back", action.reason, now)

    async def _begin(self, name: str, state: DeploymentState, config: AnalysisConfig, now: float) -> AnalysisRun:
        stored = await read_run(self.redis, name)
        if stored is not None and stored.canary == state.canary:
            if stored.status == "running":  # a restarted control: this step's window starts afresh
                stored.step_started_at, stored.judged_at = now, 0.0
            return stored
        steps = config.analysed_steps
        run = AnalysisRun(name, state.canary, state.stable, steps,
                          steps.index(state.canary_weight) if state.canary_weight in steps else -1,
                          started_at=now, step_started_at=now, updated_at=now, config=config.to_dict())
        log.info("canary analysis started", deployment=name, revision=state.canary, stable=state.stable, steps=steps)
        for decision in ("step", "promote", "rollback"):  # from 0, so increase() sees the first one
            self.decisions.labels(name, decision)
        if run.step_index < 0:
            await self._finish(run, "manual", f"the canary's weight ({state.canary_weight}%) is none of the "
                                              f"analysis' steps: set by hand", now)
        else:
            await self._save(run)
        return run

    async def _judge(self, name: str, state: DeploymentState, run: AnalysisRun, config: AnalysisConfig,
                     now: float) -> Verdict:
        canary, stable = self.book.get(name, state.canary), self.book.get(name, state.stable)
        first = canary.first_at(run.step_started_at)
        if first is None:
            return Verdict("wait", f"the canary has served no request at {run.step}% yet", run.step)
        # Both revisions over the same span: from the canary's first request at this step.
        start = max(run.step_started_at, first - 1e-6)
        value, error = None, None
        if config.prometheus is not None:
            query = string.Template(config.prometheus.query).safe_substitute(
                deployment=name, canary=str(state.canary), stable=str(state.stable))
            try:
                if self._http is None:
                    self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
                value = await prometheus_value(self._http, config.prometheus.url, query)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        return judge(config, run.step, canary.window(start, now), stable.window(start, now), now - start, value, error)

    async def _finish(self, run: AnalysisRun, status: str, reason: str, now: float) -> None:
        run.status, run.reason, run.updated_at = status, reason, now
        log.info("canary analysis ended", deployment=run.deployment, revision=run.canary, status=status, reason=reason)
        await self._save(run)

    async def _save(self, run: AnalysisRun) -> None:
        await self.redis.set(keys.deployment_analysis(run.deployment), run.to_json())
