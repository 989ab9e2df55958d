"""One request is one trace: gateway, scheduler and engine spans, exported over real OTLP/HTTP."""

import secrets

import openai
from opentelemetry.proto.trace.v1.trace_pb2 import Span

MODEL = "tiny-b"


def spans_of(otlp, request_id: str, services: set[str]):
    """Every span of the request once each service has exported its own."""
    found = []

    def complete(_span) -> bool:
        found[:] = [s for s in otlp.spans if s.attributes.get("strata.request_id") == request_id]
        trace_ids = {s.trace_id for s in found}
        return {s.service for s in found} >= services and len(trace_ids) == 1 and any(
            s.trace_id in trace_ids and s.name == "engine.decode" for s in otlp.spans)

    otlp.wait_for(complete)
    trace_id = found[0].trace_id if found else None
    return [s for s in otlp.spans if s.trace_id == trace_id]


def test_one_request_gives_one_trace_across_the_services(obs_stack, otlp):
    client = openai.OpenAI(base_url=obs_stack.base_url + "/v1", api_key=obs_stack.api_key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Trace me"}], max_tokens=6, temperature=0,
        user="end-user-42", extra_body={"ignore_eos": True})
    response = raw.parse()
    rid = raw.headers["x-request-id"]
    spans = spans_of(otlp, rid, {"strata-gateway", "strata-scheduler", "strata-engine"})
    by_name = {s.name: s for s in spans}
    assert {"chat tiny-b", "route tiny-b", "generate tiny-b", "engine.queue", "engine.prefill",
            "engine.decode"} <= set(by_name), sorted(by_name)

    gateway, route, generate = by_name["chat tiny-b"], by_name["route tiny-b"], by_name["generate tiny-b"]
    assert gateway.service == "strata-gateway" and gateway.kind == Span.SPAN_KIND_SERVER
    assert gateway.parent_span_id == ""  # the client sent no traceparent: the gateway starts the trace
    assert route.service == "strata-scheduler" and route.parent_span_id == gateway.span_id
    assert generate.service == "strata-engine" and generate.parent_span_id == route.span_id
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        assert by_name[phase].parent_span_id == generate.span_id
    # The phases follow each other inside the engine span, which lies inside the gateway's.
    queue, prefill, decode = (by_name[p] for p in ("engine.queue", "engine.prefill", "engine.decode"))
    assert generate.start_ns == queue.start_ns <= queue.end_ns == prefill.start_ns <= prefill.end_ns
    assert prefill.end_ns == decode.start_ns <= decode.end_ns <= generate.end_ns
    assert gateway.start_ns <= route.start_ns <= generate.start_ns <= generate.end_ns <= gateway.end_ns

    a = gateway.attributes  # GenAI semantic conventions
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == response.usage.completion_tokens == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["http.response.status_code"] == 200
    assert a["strata.replica_id"] in ("engine-b0", "engine-b1")
    assert a["user.id"] == "end-user-42"  # OpenAI's `user`
    r = route.attributes
    assert r["strata.routing.policy"] == "round_robin"
    assert sorted(r["strata.routing.candidates"]) == ["engine-b0", "engine-b1"]
    assert r["strata.routing.chosen"] == a["strata.replica_id"] == generate.attributes["strata.replica_id"]
    assert generate.attributes["gen_ai.usage.output_tokens"] == 6


def test_a_clients_trace_continues_through_strata(obs_stack, otlp):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=obs_stack.base_url + "/v1", api_key=obs_stack.api_key, max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Continue my trace", max_tokens=3,
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    spans = spans_of(otlp, raw.headers["x-request-id"], {"strata-gateway", "strata-scheduler", "strata-engine"})
    assert spans and {s.trace_id for s in spans} == {trace_id}
    gateway = next(s for s in spans if s.service == "strata-gateway")
    assert gateway.parent_span_id == parent and gateway.name == "text_completion tiny-b"
