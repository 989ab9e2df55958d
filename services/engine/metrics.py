"""Prometheus metrics of an engine replica, with vLLM's names under the `strata:` prefix, and
the same series again under vLLM's own names and labels (`vllm:...{model_name, engine}`), so
dashboards, alerts, KEDA/HPA rules and scrapers written for vLLM work unchanged."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from services.engine.model_runner import STEP_PHASES, StepTimings

_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model: str, replica_id: str):
        self.registry = CollectorRegistry()
        labels = ["model_name", "replica"]
        self._values = {"model_name": model, "replica": replica_id}
        r = self.registry
        vllm_named = []  # the families vLLM has too (not the step phases, which are Strata's own)

        def family(metric):
            vllm_named.append(metric)
            return metric

        def gauge(name, doc):
            return family(Gauge(name, doc, labels, registry=r)).labels(**self._values)

        def counter(name, doc):
            return family(Counter(name, doc, labels, registry=r)).labels(**self._values)

        def histogram(name, doc):
            return family(Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)).labels(**self._values)

        self.running = gauge("strata:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("strata:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("strata:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.prefix_queries = counter("strata:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("strata:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("strata:num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("strata:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("strata:generation_tokens", "Tokens generated.")
        self.ttft = histogram("strata:time_to_first_token_seconds", "Time to first token (engine arrival).")
        self.itl = histogram("strata:inter_token_latency_seconds", "Time between consecutive streamed tokens.")
        self.e2e = histogram("strata:e2e_request_latency_seconds", "Engine arrival to final token.")
        self.queue_time = histogram("strata:request_queue_time_seconds", "Time waiting before the first schedule.")
        self.prefill_time = histogram("strata:request_prefill_time_seconds", "First schedule to first token.")
        self.decode_time = histogram("strata:request_decode_time_seconds", "First token to finish.")
        self._step_phase = Histogram("strata:engine_step_seconds",
                                     "Engine step time by phase; `other` is the wall time no named phase covers "
                                     "(Python between phases, GIL and launch overhead).",
                                     labels + ["phase"], buckets=_STEP_BUCKETS, registry=r)
        self._step_phases = {phase: self._step_phase.labels(**self._values, phase=phase) for phase in STEP_PHASES}
        self.step_duration = Histogram("strata:engine_step_duration_seconds",
                                       "Engine step wall time (the sum of its phases).", labels,
                                       buckets=_STEP_BUCKETS, registry=r).labels(**self._values)
        self._success = family(Counter("strata:request_success", "Finished requests by reason.",
                                       labels + ["finished_reason"], registry=r))
        # LoRA, as vLLM names it: one sample whose labels list the adapters of running and
        # waiting requests (comma-separated) and the slot count; its value is when it was set.
        self._lora_info = family(Gauge("strata:lora_requests_info", "LoRA adapters of running and waiting requests.",
                                       labels + ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                                       registry=r))
        r.register(VllmNames(vllm_named))
        # Strata's own: requests that waited in an admission queue for this replica to start.
        self.cold_start_requests = Counter("strata:cold_start_requests",
                                           "Requests that reached a scheduler before this replica was ready, and "
                                           "waited in its admission queue.", labels, registry=r).labels(**self._values)
        self.cold_start_wait = Counter("strata:cold_start_wait_seconds",
                                       "Seconds those requests waited before this replica was ready (its cold start), "
                                       "summed.", labels, registry=r).labels(**self._values)
        # Strata's own: LoRA adapter slot fills, evictions and disk reads.
        self.lora_loads = Counter("strata:lora_adapter_loads", "LoRA adapters made resident in a device slot.",
                                  labels, registry=r).labels(**self._values)
        self.lora_evictions = Counter("strata:lora_adapter_evictions",
                                      "Resident LoRA adapters replaced by another in their device slot.",
                                      labels, registry=r).labels(**self._values)
        self.lora_disk_loads = Counter("strata:lora_adapter_disk_loads", "LoRA adapters read from disk into host memory.",
                                       labels, registry=r).labels(**self._values)
        self._last = {"queries": 0, "hits": 0, "preemptions": 0, "lora_loads": 0, "lora_evictions": 0,
                      "lora_disk_loads": 0}
        # Speculative decoding, as vLLM's spec_decode metrics.
        self.spec_drafts = counter("strata:spec_decode_num_drafts", "Speculated runs verified (one per sequence "
                                                                    "per step that had drafts).")
        self.spec_draft_tokens = counter("strata:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted_tokens = counter("strata:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_accepted_per_pos = family(Counter("strata:spec_decode_num_accepted_tokens_per_pos",
                                                     "Draft tokens accepted, by position in the speculated run "
                                                     "(0 = first).", labels + ["position"], registry=r))
        self._last_spec = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                           "spec_decode_num_accepted_tokens": 0}
        self._last_spec_per_pos: list[int] = []
        self.recent_ttft = LatencyWindow()
        self.recent_itl = LatencyWindow()
        self.finished_total = 0
        self.failed_total = 0

    def observe_step(self, step: StepTimings) -> None:
        """One step's phases (called on the engine thread; prometheus_client is thread-safe)."""
        for phase, hist in self._step_phases.items():
            hist.observe(getattr(step, phase))
        self.step_duration.observe(step.wall)

    def finished(self, reason: str) -> None:
        self._success.labels(**self._values, finished_reason=reason).inc()
        self.finished_total += 1
        self.failed_total += reason == "error"

    def arrived(self, timestamps: dict[str, float], ready_at: float) -> None:
        """A request's hop timestamps (unix seconds) on arrival: one that was queued at a
        scheduler before this replica was ready waited (also) for its cold start."""
        received = timestamps.get("scheduler_received")
        if received is not None and "scheduler_dequeued" in timestamps and received < ready_at:
            self.cold_start_requests.inc()
            self.cold_start_wait.inc(ready_at - received)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.recent_ttft.add(seconds)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.recent_itl.add(seconds)

    def update_engine(self, stats: dict) -> None:
        """Mirror the engine's cumulative counters (read once per heartbeat)."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["used_blocks"] / max(stats["total_blocks"], 1))
        mirrored = [("queries", self.prefix_queries, "prefix_cache_queries"),
                    ("hits", self.prefix_hits, "prefix_cache_hits"),
                    ("preemptions", self.preemptions, "num_preemptions")]
        if "lora_loads" in stats:
            mirrored += [(k, c, k) for k, c in (("lora_loads", self.lora_loads), ("lora_evictions", self.lora_evictions),
                                                 ("lora_disk_loads", self.lora_disk_loads))]
            self._lora_info.clear()
            self._lora_info.labels(**self._values, running_lora_adapters=",".join(stats["lora_running"]),
                                   waiting_lora_adapters=",".join(stats["lora_waiting"]),
                                   max_lora=str(stats["max_loras"])).set(time.time())
        for key, counter, stat in mirrored:
            delta = stats[stat] - self._last[key]
            if delta > 0:
                counter.inc(delta)
            self._last[key] = stats[stat]
        if "spec_decode_num_drafts" in stats:
            for stat, counter in (("spec_decode_num_drafts", self.spec_drafts),
                                  ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                                  ("spec_decode_num_accepted_tokens", self.spec_accepted_tokens)):
                counter.inc(max(stats[stat] - self._last_spec[stat], 0))
                self._last_spec[stat] = stats[stat]
            per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
            last = self._last_spec_per_pos + [0] * (len(per_pos) - len(self._last_spec_per_pos))
            for position, (now, before) in enumerate(zip(per_pos, last)):
                self._spec_accepted_per_pos.labels(**self._values, position=str(position)).inc(max(now - before, 0))
            self._last_spec_per_pos = list(per_pos)


class VllmNames:
    """A collector that re-exports Strata's engine series under vLLM's names: `strata:X` becomes
    `vllm:X` with vLLM's labels (`model_name`, and `engine`, the engine's index in its process:
    always "0", one engine per worker); `replica` stays as a label of its own. The values are
    the same objects' at collection time, so the two names can never disagree."""

    PREFIX, VLLM_PREFIX = "strata:", "vllm:"

    def __init__(self, families: list):
        self._families = families  # Strata's metric objects (the labelled parents)

    def collect(self):
        for metric in self._families:
            for family in metric.collect():
                name = self.VLLM_PREFIX + family.name.removeprefix(self.PREFIX)
                copy = Metric(name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    copy.add_sample(self.VLLM_PREFIX + sample.name.removeprefix(self.PREFIX),
                                    {**sample.labels, "engine": "0"}, sample.value, sample.timestamp, sample.exemplar)
                yield copy

    def describe(self):
        return []  # names are only known at collection: nothing to check for clashes at registration


class LatencyWindow:
    """Recent latencies (the last `span_s` seconds, at most `max_samples`): the live TTFT and
    inter-token figures a heartbeat carries to the scaler and the dashboard."""

    def __init__(self, span_s: float = 30.0, max_samples: int = 2048):
        self.span_s = span_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, value))

    def quantile(self, q: float, now: float | None = None) -> float | None:
        cutoff = (time.monotonic() if now is None else now) - self.span_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        return values[min(int(q * len(values)), len(values) - 1)]
