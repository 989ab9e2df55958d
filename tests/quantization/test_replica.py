"""A replica says which quantization it runs: in its heartbeats (and so the registry) and through
the gateway's /v1/models; a quantized replica serves requests like any other."""

import json
import time
import urllib.request

import pytest

from shared.localstack import LocalStack


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    # Its own NATS and Valkey (LocalStack starts them): no other stack's scheduler takes its requests.
    s = LocalStack(str(tiny_model_dir), engines=1, engine_args=["--num-kv-blocks", "256", "--threads", "1"],
                   log_dir=tmp_path_factory.mktemp("quant-stack-logs"))
    s.start()
    try:
        s.start_engine("engine-1", "--quantization", "int8", "--kv-cache-dtype", "int8")
        s.wait_ready(120)
        yield s
    finally:
        s.stop()


def get(stack, path: str) -> dict:
    req = urllib.request.Request(stack.base_url + path, headers={"Authorization": f"Bearer {stack.api_key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def post(stack, path: str, body: dict) -> dict:
    req = urllib.request.Request(stack.base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {stack.api_key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_models_list_each_replicas_quantization(stack):
    deadline = time.monotonic() + 10
    while True:  # both replicas registered (the second may still be on its first heartbeat)
        entry = next(m for m in get(stack, "/v1/models")["data"] if m["id"] == stack.deployment)
        replicas = {r["replica_id"]: r for r in entry.get("strata", {}).get("replicas", [])}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert replicas["engine-0"] == {"replica_id": "engine-0", "quantization": "none", "kv_cache_dtype": "auto"}
    assert replicas["engine-1"] == {"replica_id": "engine-1", "quantization": "int8", "kv_cache_dtype": "int8"}


def test_requests_are_served_by_both_replicas(stack):
    served = set()
    for i in range(30):  # ties between idle replicas are broken at random
        body = post(stack, "/v1/completions", {"model": stack.deployment, "prompt": f"Count to {i}:",
                                               "max_tokens": 4, "temperature": 0})
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        served.add(body["strata"]["replica_id"])
        if len(served) == 2:
            break
    assert served == {"engine-0", "engine-1"}
