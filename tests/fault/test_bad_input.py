"""Hostile input: the HTTP API fuzzed from its own OpenAPI description (no 5xx, every error in
OpenAI's shape), and malformed, truncated, oversized and ill-typed msgpack on every subject the
services listen to (engine, scheduler, gateway, control, scaler), after which they still serve."""

import asyncio
import inspect
import json
import os
import typing
import urllib.error
import urllib.request

import aiohttp
import jsonschema
import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from services.gateway.openapi import openapi_spec
from shared import protocol
from shared.bus import Bus
from tests.fault.conftest import make_stack, stream_completion

MODEL = "tiny-llama"
ERROR_SCHEMA = openapi_spec()["components"]["schemas"]["Error"]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = make_stack(tiny_model_dir, tmp_path_factory.mktemp("bad-input-logs"), engines=1, control=True, scaler=True,
                   scaler_args=["--engine-arg=--threads=1"])
    yield s
    s.stop()


# ---- HTTP ---------------------------------------------------------------------------------------
def call(stack, method: str, path: str, body: bytes | None = None, key: str | None = "stack") -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "Strata-Timeout": "20"}
    if key is not None:
        headers["Authorization"] = f"Bearer {stack.api_key if key == 'stack' else key}"
    request = urllib.request.Request(stack.base_url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def check_response(status: int, raw: bytes, what) -> None:
    assert status < 500, (status, raw[:500], what)
    if status >= 400:
        jsonschema.validate(json.loads(raw), ERROR_SCHEMA)
        return
    if raw.startswith(b"data: "):  # a stream: an error in it comes in OpenAI's shape too
        for line in raw.split(b"\n\n"):
            if line.startswith(b"data: {") and b'"error"' in line:
                jsonschema.validate(json.loads(line[6:]), ERROR_SCHEMA)
                assert json.loads(line[6:])["error"]["code"] not in ("internal",), (line, what)


def fuzz_schema(schema: dict) -> dict:
    """The request schema with generation bounded (the fuzz must not spend minutes generating)
    and the served model named half of the time (else nearly every body is a 404)."""
    spec = openapi_spec()
    schema = json.loads(json.dumps(schema))
    schema["components"] = spec["components"]
    props = schema["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            props[name] = {"type": "integer", "minimum": -2, "maximum": 4}
    schema["required"] = [*schema["required"], "max_tokens"]  # chat's default is "as many as fit"
    props["model"] = {"anyOf": [{"const": MODEL}, {"type": "string"}]}
    return schema


def body_strategy(name: str):
    schemas = openapi_spec()["components"]["schemas"]
    valid = from_schema(fuzz_schema(schemas[name]))
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda children: st.lists(children, max_size=4)
                               | st.dictionaries(st.text(max_size=12), children, max_size=4), max_leaves=12)
    # Schema-valid bodies with one field replaced by anything at all, and arbitrary JSON.
    mutated = st.tuples(valid, st.sampled_from(sorted(schemas[name]["properties"])), json_values).map(
        lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, mutated, json_values).map(lambda v: json.dumps(v).encode())


@pytest.mark.slow
@pytest.mark.parametrize("path,schema", [("/v1/completions", "CompletionRequest"),
                                         ("/v1/chat/completions", "ChatCompletionRequest")])
def test_fuzzed_requests_get_no_5xx_and_openai_shaped_errors(stack, path, schema):
    # 80 bodies per path in CI (the suite must fit its hour); STRATA_FUZZ_EXAMPLES=2000 for a longer hunt.
    @settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "80")), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=body_strategy(schema))
    def fuzz(body):
        status, raw = call(stack, "POST", path, body)
        check_response(status, raw, body)

    fuzz()


def test_every_path_of_the_openapi_description_answers_without_5xx(stack):
    status, raw = call(stack, "GET", "/openapi.json")
    assert status == 200
    paths = json.loads(raw)["paths"]
    for path, methods in paths.items():
        for method in methods:
            for body in (None, b"", b"null", b"{}"):
                status, raw = call(stack, method.upper(), path, body if method == "post" else None)
                check_response(status, raw, (method, path, body))


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny-llama", "prompt": "\xff\xfe\xfd invalid utf-8"}',
    b'\xef\xbb\xbf{"model": "tiny-llama", "prompt": "a byte order mark"}',
    b'{"model": "tiny-llama", "prompt": "\\ud800 a lone surrogate"}',
    b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 1000000000000}',
    b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 100000000000000000000000000000}',
    b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 1e400}',
    b'{"model": "tiny-llama", "prompt": "x", "max_tokens": "16"}',
    b'{"model": "tiny-llama", "prompt": [[1, 2], "x", 5]}',  # a batch with a bare token id in it
    b'{"model": "tiny-llama", "prompt": {"text": "x"}}',
    b'{"model": "no-such-model", "prompt": "x"}',
    b'{"model": ["tiny-llama"], "prompt": "x"}',
    b'{"model": "tiny-llama", "prompt": "x", "stream": "yes"}',
    b'{"model": "tiny-llama", "prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", '
    b'"l", "m", "n", "o", "p", "q"]}',
])
def test_edge_case_bodies_are_clear_400s_or_404s(stack, raw):
    status, body = call(stack, "POST", "/v1/completions", raw)
    assert status in (400, 404), (status, body)
    jsonschema.validate(json.loads(body), ERROR_SCHEMA)


def test_a_prompt_at_the_context_limit_with_huge_max_tokens_is_refused_before_any_work(stack):
    status, body = call(stack, "POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode())
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded", body
    status, body = call(stack, "POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**62}).encode())
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens", body
    status, body = call(stack, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [5] * 2048}).encode())
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded", body


# ---- msgpack on the bus -----------------------------------------------------------------------
def subject_functions() -> dict[str, object]:
    """Every function of shared.protocol that names a subject."""
    found = {}
    for name, fn in inspect.getmembers(protocol, inspect.isfunction):
        if fn.__module__ != protocol.__name__ or name.startswith("_"):
            continue
        try:
            subject = fn(*["probe"] * len(inspect.signature(fn).parameters))
        except Exception:  # encode, decode: not subjects
            continue
        if isinstance(subject, str) and subject.startswith(protocol.PREFIX + "."):
            found[name] = fn
    return found


def subject_constants() -> dict[str, str]:
    return {name: value for name, value in vars(protocol).items()
            if name.isupper() and isinstance(value, str) and value.startswith(protocol.PREFIX + ".")}


def targets(stack) -> list[tuple[str, str, type]]:
    """(what, concrete subject, the message type listened for) for every subject in shared.protocol;
    the test fails when a new subject appears that this list does not fuzz."""
    replica, model = "engine-0", stack.deployment
    concrete = {
        "GENERATE": (protocol.GENERATE, protocol.GenerateRequest),
        "CANCEL": (protocol.CANCEL, protocol.Cancel),
        "HEARTBEAT_ALL": (protocol.heartbeat(replica), protocol.Heartbeat),
        "heartbeat": (protocol.heartbeat("fuzzed-replica"), protocol.Heartbeat),
        "KV_EVENTS_ALL": (protocol.kv_events(model, replica), protocol.KvEventBatch),
        "kv_events": (protocol.kv_events("fuzzed-model", "fuzzed-replica"), protocol.KvEventBatch),
        "SCHEDULER_STATS_ALL": (protocol.scheduler_stats("scheduler-0"), protocol.SchedulerStats),
        "scheduler_stats": (protocol.scheduler_stats("fuzzed-scheduler"), protocol.SchedulerStats),
        "CONTROL_DEPLOYMENTS": (protocol.CONTROL_DEPLOYMENTS, protocol.DeploymentChanged),
        "CONTROL_KEYS": (protocol.CONTROL_KEYS, protocol.KeyRevoked),
        "SCALER_STATUS": (protocol.SCALER_STATUS, protocol.ScalerDecision),
        "CONTROL_POOLS": (protocol.CONTROL_POOLS, protocol.PoolChanged),
        "SCALER_POOLS": (protocol.SCALER_POOLS, protocol.PoolStatus),
        "GATEWAY_STATS_ALL": (protocol.gateway_stats("gateway-0"), protocol.GatewayStats),
        "gateway_stats": (protocol.gateway_stats("fuzzed-gateway"), protocol.GatewayStats),
        "engine_generate": (protocol.engine_generate(replica), protocol.GenerateRequest),
        "ENGINE_GENERATE_ALL": (protocol.engine_generate(replica), protocol.GenerateRequest),
        "ENGINE_KV_SNAPSHOT_ALL": (protocol.engine_kv_snapshot(replica), protocol.KvSnapshotRequest),
        "engine_kv_snapshot": (protocol.engine_kv_snapshot(replica), protocol.KvSnapshotRequest),
        "LORA_ADAPTERS_ALL": (protocol.lora_adapters(model), protocol.LoraAdaptersChanged),
        "lora_adapters": (protocol.lora_adapters("fuzzed-model"), protocol.LoraAdaptersChanged),
        # Read by `strata logs` (kept a while by JetStream), not by a service: garbage must not stop them.
        "LOGS_ALL": (protocol.logs("gateway", "gateway"), protocol.LogLine),
        "logs": (protocol.logs("fuzzed", "fuzzed"), protocol.LogLine),
    }
    assert set(concrete) == set(subject_constants()) | set(subject_functions()), "a subject is not fuzzed"
    return [(name, subject, cls) for name, (subject, cls) in concrete.items()]


def valid_example(cls) -> dict:
    """A valid payload of the message type: required fields, and optional ones of simple types."""
    examples = {str: "x", int: 1, float: 1.0, bool: True}
    hints = typing.get_type_hints(cls)
    out = {"v": protocol.SCHEMA_VERSION}
    for f in msgspec.structs.fields(cls):
        hint = hints[f.name]
        simple = [examples[a] for a in typing.get_args(hint) or [hint] if a in examples]
        if f.required:
            out[f.name] = {"error": {"code": "x", "message": "x"}}.get(f.name, simple[0] if simple else "x")
        elif simple:
            out[f.name] = simple[0]
    if cls is protocol.GenerateRequest:
        out.update(reply_to="_INBOX.fuzz", prompt_token_ids=[1, 2, 3])
    return out


def ill_typed(example: dict) -> dict:
    """Every field of the wrong type."""
    swap = {str: 12345, int: "12", float: "1.5", bool: "true", list: {"a": 1}, dict: [1, 2]}
    return {k: (v if k == "v" else swap.get(type(v), None)) for k, v in example.items()}


MAYBE_VALID = {"oversized", "oversized hashes", "bad subject tokens"}  # well-formed enough to be valid for some types


def payloads(cls) -> list[tuple[str, bytes]]:
    example = valid_example(cls)
    valid = msgpack.packb(example)
    big_list = [2**64 - 1] * 50_000  # twice: ~900 KB, under NATS' 1 MB limit
    return [
        ("empty", b""),
        ("garbage", os.urandom(256)),
        ("reserved byte", b"\xc1"),
        ("truncated", valid[:len(valid) // 2]),
        ("not a map", msgpack.packb([1, 2, 3])),
        ("a string", msgpack.packb("strata")),
        ("no version", msgpack.packb({k: v for k, v in valid_example(cls).items() if k != "v"})),
        ("future version", msgpack.packb({**valid_example(cls), "v": 99})),
        ("ill-typed", msgpack.packb(ill_typed(valid_example(cls)))),
        ("deep nesting", b"\x91" * 200_000 + b"\xc0"),
        ("ext type", msgpack.packb({**example, next(k for k in example if k != "v"): msgpack.ExtType(5, b"xx")})),
        ("non-utf8 str", valid.replace(b"\xa1x", b"\xa1\xff", 1)),
        ("oversized", msgpack.packb({**valid_example(cls), "padding": big_list, "prompt_token_ids": big_list})),
        ("oversized hashes", msgpack.packb({**valid_example(cls), "token_ids": big_list, "block_hashes": big_list})),
        ("bad subject tokens", msgpack.packb({**valid_example(cls), "replica_id": "a.b >", "model": "*",
                                              "reply_to": "_INBOX.>"})),
    ]


async def test_garbage_on_every_subject_leaves_every_service_serving(stack):
    bus = await Bus.connect(stack.infra.nats_url_as("admin"), "fuzzer")
    replies = {}
    try:
        for name, subject, cls in targets(stack):
            for what, payload in payloads(cls):
                await bus.nc.publish(subject, payload)
                if name in ("GENERATE", "engine_generate", "engine_kv_snapshot"):  # they answer requests
                    try:
                        reply = await bus.nc.request(subject, payload, timeout=5)
                        replies[(name, what)] = reply.data
                    except Exception as exc:
                        replies[(name, what)] = exc
        await bus.nc.flush(timeout=10)
    finally:
        await bus.close()
    for (name, what), reply in replies.items():
        if what in MAYBE_VALID:
            continue
        assert isinstance(reply, bytes), (name, what, reply)
        error = protocol.decode(protocol.ErrorReply, reply).error
        assert error.code == "bad_request" and error.message, (name, what, error)
    await assert_still_serving(stack)
    for service in ("engine-0", "scheduler-0", "gateway", "control", "scaler"):
        log = (stack.log_dir / f"{service}.log").read_text()
        assert "malformed message" in log, f"{service} never saw the garbage"


async def test_garbage_on_a_live_requests_reply_and_routing_subjects_does_not_disturb_it(stack):
    bus = await Bus.connect(stack.infra.nats_url_as("admin"), "fuzzer")
    seen: set[str] = set()

    async def spy(msg):
        seen.add(msg.subject)
    await bus.nc.subscribe("_INBOX.gateway.gw.>", cb=spy)
    try:
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(stream_completion(
                http, stack.base_url, stack.api_key, {"model": MODEL, "prompt": "Keep talking", "max_tokens": 48,
                                                      "temperature": 0, "ignore_eos": True}))
            while len(seen) < 2 and not request.done():  # its reply subject and its acceptance notice
                await asyncio.sleep(0.01)
            for subject in seen:
                for _, payload in payloads(protocol.TokenChunk):
                    await bus.nc.publish(subject, payload)
            out = await asyncio.wait_for(request, 60)
    finally:
        await bus.close()
    assert any(s.endswith(".accepted") for s in seen) and len(seen) == 2, seen
    assert out.ok and out.usage["completion_tokens"] == 48, out


async def assert_still_serving(stack) -> None:
    for name, proc in stack.services.items():
        assert proc.poll() is None, f"{name} died"
    async with aiohttp.ClientSession() as http:
        out = await stream_completion(http, stack.base_url, stack.api_key,
                                      {"model": MODEL, "prompt": "still there?", "max_tokens": 8})
        assert out.ok, out
        async with http.get(stack.control_url + "/health") as resp:
            assert resp.status == 200
