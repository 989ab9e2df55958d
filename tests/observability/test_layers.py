"""Per-request layer timings: they add up to the latency the client measures, and reach /metrics."""

import json
import time

import aiohttp
import openai

from shared.layers import COMPONENT, LAYER_NAMES

MODEL = "tiny-b"
# Stated tolerance: what the client measures on top of the layers is its own work (building and
# sending the HTTP request, reading and parsing the answer) and the gateway's last write: at
# most 15 ms or 10% of the request, whichever is larger (2 shared CPU cores; timing noise).
# Measured on the tiny model, warm client: 3-4 ms over requests of 100-140 ms.
TOLERANCE_S, TOLERANCE_FRACTION = 0.015, 0.10


def check_sum(timings: dict, client_s: float) -> float:
    layers = sum(timings[name] for name in LAYER_NAMES)
    assert set(timings) == {*LAYER_NAMES, "e2e"}
    # Every stretch between the hop stamps is in exactly one layer: equal to the gateway's e2e
    # up to the rounding of each figure to the microsecond.
    assert abs(layers - timings["e2e"]) <= 1e-5, timings
    overhead = client_s - layers
    assert 0 <= overhead <= max(TOLERANCE_S, TOLERANCE_FRACTION * client_s), (client_s, timings)
    assert timings["engine_prefill"] > 0 and timings["engine_decode"] > 0 and timings["bus"] > 0
    return overhead


def test_layer_timings_add_up_to_the_client_measured_latency(obs_stack, capsys):
    client = openai.OpenAI(base_url=obs_stack.base_url + "/v1", api_key=obs_stack.api_key, max_retries=0)
    # Warm up: the client's first calls open its connection and import what they need.
    client.completions.create(model=MODEL, prompt="warm", max_tokens=1)
    for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "warm"}], max_tokens=1,
                                            stream=True, stream_options={"include_usage": True}):
        pass
    overheads = []
    for i in range(3):
        start = time.perf_counter()
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"Timing {i} " * 20, max_tokens=24,
                                                          temperature=0, extra_body={"ignore_eos": True})
        body = json.loads(raw.text)
        client_s = time.perf_counter() - start
        timings = body["strata"]["timings"]
        assert json.loads(raw.headers["x-strata-timings"]) == timings  # the header of non-streaming calls
        components = body["strata"]["components"]
        assert abs(components["runtime"] + components["infrastructure"] - timings["e2e"]) <= 1e-5
        overheads.append((client_s, check_sum(timings, client_s)))

        start = time.perf_counter()  # streaming: the timings come on the usage chunk, the last one
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Stream {i}"}],
                                                max_tokens=24, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        last = None
        for chunk in stream:
            last = chunk
        client_s = time.perf_counter() - start
        assert last.usage.completion_tokens == 24
        overheads.append((client_s, check_sum(last.model_extra["strata"]["timings"], client_s)))
    with capsys.disabled():
        print("\nlayer sum vs client e2e (ms): " + ", ".join(f"{c * 1e3:.1f} (+{o * 1e3:.2f})" for c, o in overheads))


async def test_layer_histograms_on_the_gateway_metrics(obs_stack):
    async with aiohttp.ClientSession() as http:
        async with http.post(obs_stack.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                            "max_tokens": 2},
                             headers={"Authorization": f"Bearer {obs_stack.api_key}"}) as resp:
            assert resp.status == 200
        async with http.get(obs_stack.base_url + "/metrics") as resp:
            text = await resp.text()
    for name in LAYER_NAMES:
        line = next(line for line in text.splitlines() if line.startswith("strata:request_layer_seconds_count{")
                    and f'layer="{name}"' in line and f'model_name="{MODEL}"' in line)
        assert f'component="{COMPONENT[name]}"' in line and float(line.rsplit(" ", 1)[1]) >= 1
