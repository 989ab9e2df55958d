"""Where a request's time went, by layer: which hop timestamps delimit which layer.

Each hop stamps `GenerateRequest.timestamps` (unix seconds, `time.time()`); the engine returns
them, its own included, on the final `TokenChunk`, and the gateway adds its last two. In order:

    gateway_received        the HTTP request reached the gateway's handler
    gateway_published       authenticated, tokenized, handed to the bus
    scheduler_received      a scheduler took it off `strata.v1.generate`
    scheduler_dequeued      it left the admission queue (absent if it never waited there)
    scheduler_routed        the scheduler forwarded it to the engine that took it
    engine_received         the engine got it
    engine_scheduled        first scheduled in a batch
    engine_first_token      its first token was sampled
    engine_final_chunk      its final chunk went to the publisher
    gateway_final_received  the gateway got the final chunk off the bus
    gateway_done            the response was complete (all but the last write)

Every stretch between consecutive stamps belongs to exactly one layer, so the layers add up to
the gateway's end-to-end time (`e2e`, gateway_received to gateway_done) by construction; what
the client measures on top is its own HTTP work and the last write. A missing stamp takes the
value of the one before it (its stretch counts as zero). Stamps come from different processes:
on one machine their clocks agree; across machines `bus` includes the clocks' skew.
"""

from __future__ import annotations

from dataclasses import dataclass

STAMPS = ("gateway_received", "gateway_published", "scheduler_received", "scheduler_dequeued", "scheduler_routed",
          "engine_received", "engine_scheduled", "engine_first_token", "engine_final_chunk",
          "gateway_final_received", "gateway_done")


@dataclass(frozen=True)
class Layer:
    name: str
    component: str  # runtime | infrastructure | tooling: the design's layer that owns it
    stretches: tuple[tuple[str, str], ...]  # (from stamp, to stamp)
    doc: str


LAYERS = (
    Layer("gateway", "infrastructure",
          (("gateway_received", "gateway_published"), ("gateway_final_received", "gateway_done")),
          "auth, rate limit, tokenization, response assembly"),
    Layer("admission_wait", "infrastructure", (("scheduler_received", "scheduler_dequeued"),),
          "waiting in the scheduler's admission queue (every replica saturated)"),
    Layer("routing", "infrastructure", (("scheduler_dequeued", "scheduler_routed"),),
          "choosing a replica (prefix index, retries on refusing replicas)"),
    Layer("bus", "infrastructure",
          (("gateway_published", "scheduler_received"), ("scheduler_routed", "engine_received"),
           ("engine_final_chunk", "gateway_final_received")),
          "NATS transit: gateway to scheduler, scheduler to engine, the final chunk back"),
    Layer("engine_queue", "runtime", (("engine_received", "engine_scheduled"),),
          "waiting in the engine for a batch slot or KV blocks"),
    Layer("engine_prefill", "runtime", (("engine_scheduled", "engine_first_token"),),
          "prompt processing up to the first token"),
    Layer("engine_decode", "runtime", (("engine_first_token", "engine_final_chunk"),),
          "generating the remaining tokens"),
)
LAYER_NAMES = tuple(layer.name for layer in LAYERS)
COMPONENT = {layer.name: layer.component for layer in LAYERS}


def complete(timestamps: dict[str, float]) -> dict[str, float]:
    """Every stamp, a missing one taking the value of the one before it."""
    out: dict[str, float] = {}
    previous = None
    for name in STAMPS:
        value = timestamps.get(name, previous)
        if value is None:  # nothing before it either: the request never reached the gateway
            continue
        out[name] = previous = value
    return out


def layer_timings(timestamps: dict[str, float]) -> dict[str, float]:
    """Seconds per layer (LAYER_NAMES order) plus `e2e`; negative stretches (clock skew across
    machines) count as zero."""
    ts = complete(timestamps)
    out = {}
    for layer in LAYERS:
        out[layer.name] = sum(max(ts.get(b, 0.0) - ts.get(a, 0.0), 0.0) for a, b in layer.stretches)
    out["e2e"] = max(ts.get("gateway_done", 0.0) - ts.get("gateway_received", 0.0), 0.0)
    return out


def by_component(timings: dict[str, float]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for name in LAYER_NAMES:
        totals[COMPONENT[name]] = totals.get(COMPONENT[name], 0.0) + timings.get(name, 0.0)
    return totals
