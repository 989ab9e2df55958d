"""NATS messages per engine step: one message per request per step (no `batch_to`, as every
stream was before issue 17) vs one TokenChunkBatch per step per gateway, at 32 concurrent streams.

One engine worker process (the tiny model unless --model) on an embedded NATS; the client
stands for one or two gateways. Arms, interleaved round by round in one run:
  per_request  batch_to unset: one TokenChunk per request per step on its reply_to
  batched_1gw  every request names one batch_to: one TokenChunkBatch per step
  batched_2gw  half the requests name one subject, half another: two batches per step
Counted per arm: messages the engine's connection published (nats-server /connz in_msgs: chunks,
batches, acks, KV events, load reports), chunk messages the client received, engine steps (its
/metrics), engine and client CPU seconds, tokens/s. Prints a table; writes
bench/results/chunk_batching.json and a PNG.

    python bench/chunk_batching.py [--streams 32] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from statistics import median
from urllib.parse import urlparse

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench.common import pyplot, write_results  # noqa: E402
from shared import aio, keys, protocol  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.localstack import LocalInfra, engine_module_args  # noqa: E402
from shared.protocol import GenerateRequest, SamplingParams, TokenChunk, TokenChunkBatch  # noqa: E402
from shared.store import connect_redis  # noqa: E402
from shared.tiny_model import ensure_tiny_model  # noqa: E402

ARMS = ("per_request", "batched_1gw", "batched_2gw")
REPLICA = "bench-batching"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def engine_published(monitor_url: str) -> int:
    """Messages the engine's main connection has published (not its heartbeat thread's)."""
    conns = get_json(f"{monitor_url}/connz?limit=4096")["connections"]
    return next(c["in_msgs"] for c in conns if c.get("name") == f"engine-{REPLICA}")


def engine_steps(http_url: str) -> int:
    with urllib.request.urlopen(http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(r"^strata:engine_step_duration_seconds_count\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return int(float(match.group(1)))


async def start_engine(infra: LocalInfra, model_dir: Path, log_path: Path, flags: list[str]):
    cmd = [sys.executable, "-m", *engine_module_args(model_dir, REPLICA, "bench", infra, *flags)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    redis = connect_redis(infra.redis_url)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}: see {log_path}")
            entry = await redis.hgetall(keys.replica(REPLICA))
            if entry.get(b"state") == b"ready":
                return proc, entry[b"http_url"].decode()
            await asyncio.sleep(0.2)
        raise TimeoutError(f"engine not ready: see {log_path}")
    finally:
        await redis.aclose()


async def run_arm(bus: Bus, arm: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """32 streams at once; returns what the client saw."""
    gateways = {"per_request": [None], "batched_1gw": [f"_INBOX.bench.gw0.{uuid.uuid4().hex[:8]}"],
                "batched_2gw": [f"_INBOX.bench.gw{i}.{uuid.uuid4().hex[:8]}" for i in range(2)]}[arm]
    requests = []
    for i, prompt in enumerate(prompts):
        rid = uuid.uuid4().hex
        requests.append(GenerateRequest(
            request_id=rid, model="bench", reply_to=f"_INBOX.bench.r.{rid}", prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            batch_to=gateways[i % len(gateways)]))
    pending = {r.request_id for r in requests}
    done = asyncio.Event()
    seen = {"messages": 0, "tokens": 0}

    def take(chunks: list[TokenChunk]) -> None:
        for c in chunks:
            seen["tokens"] += len(c.token_ids)
            if c.is_final:
                pending.discard(c.request_id)
        if not pending:
            done.set()

    async def on_chunk(msg):
        seen["messages"] += 1
        take([protocol.decode(TokenChunk, msg.data)])

    async def on_batch(msg):
        seen["messages"] += 1
        take(protocol.decode(TokenChunkBatch, msg.data).chunks)

    if arm == "per_request":
        subs = [await bus.nc.subscribe("_INBOX.bench.r.*", cb=on_chunk)]
    else:
        subs = [await bus.nc.subscribe(g, cb=on_batch) for g in gateways]
    subject = protocol.engine_generate(REPLICA)
    start = time.perf_counter()
    try:
        await asyncio.gather(*(bus.publish(subject, r) for r in requests))
        await asyncio.wait_for(done.wait(), 300)
    finally:
        elapsed = time.perf_counter() - start
        for sub in subs:
            await sub.unsubscribe()
    return {**seen, "seconds": elapsed}


async def main_async(args) -> dict:
    model_dir = Path(args.model) if args.model else ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    rng = random.Random(args.seed)
    flags = ["--max-num-seqs", str(max(args.streams, 64)), "--num-kv-blocks", "4096", "--log-level", "warning",
             *args.engine_arg]
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    me = psutil.Process()
    with LocalInfra() as infra:
        monitor = infra.nats_monitor_url(urlparse(infra.nats_url.split(",")[0]).port)
        proc, http_url = await start_engine(infra, model_dir, Path(args.log_dir) / "engine.log", flags)
        engine = psutil.Process(proc.pid)
        bus = await Bus.connect(infra.nats_url, "bench-batching")
        try:
            for round_no in range(args.rounds + 1):  # round 0 warms up and is not counted
                for arm in ARMS:
                    prompts = [[rng.randrange(8, 4000) for _ in range(args.prompt_tokens)]
                               for _ in range(args.streams)]
                    await asyncio.sleep(0.3)  # the previous arm's last messages (load reports) are out
                    before = (engine_published(monitor), engine_steps(http_url), sum(engine.cpu_times()[:2]),
                              sum(me.cpu_times()[:2]))
                    seen = await run_arm(bus, arm, prompts, args.max_tokens)
                    await asyncio.sleep(0.3)
                    after = (engine_published(monitor), engine_steps(http_url), sum(engine.cpu_times()[:2]),
                             sum(me.cpu_times()[:2]))
                    published, steps, engine_cpu, client_cpu = (a - b for a, b in zip(after, before))
                    run = {"engine_messages": published, "steps": steps, "client_messages": seen["messages"],
                           "tokens": seen["tokens"], "seconds": seen["seconds"],
                           "tokens_per_s": seen["tokens"] / seen["seconds"],
                           "engine_messages_per_step": published / steps,
                           "chunk_messages_per_step": seen["messages"] / steps,
                           "engine_cpu_ms_per_1k_tokens": engine_cpu / seen["tokens"] * 1e6,
                           "client_cpu_ms_per_1k_tokens": client_cpu / seen["tokens"] * 1e6}
                    if round_no:
                        runs[arm].append(run)
                    print(f"round {round_no} {arm:12s} steps {steps:4d}  engine msgs {published:5d} "
                          f"({run['engine_messages_per_step']:.2f}/step)  chunk msgs/step "
                          f"{run['chunk_messages_per_step']:.2f}  {run['tokens_per_s']:.0f} tok/s", flush=True)
        finally:
            await bus.close()
            proc.terminate()
            proc.wait(30)
    keys_ = ("engine_messages_per_step", "chunk_messages_per_step", "tokens_per_s", "engine_cpu_ms_per_1k_tokens",
             "client_cpu_ms_per_1k_tokens")
    summary = {arm: {k: median(r[k] for r in runs[arm]) for k in keys_} for arm in ARMS}
    base = summary["per_request"]
    print(f"\nmedians of {args.rounds} rounds, {args.streams} streams x {args.max_tokens} tokens:")
    print(f"{'arm':12s} {'engine msgs/step':>17s} {'chunk msgs/step':>16s} {'tok/s':>8s} "
          f"{'engine CPU ms/1k tok':>21s} {'client CPU ms/1k tok':>21s}")
    for arm in ARMS:
        s = summary[arm]
        print(f"{arm:12s} {s['engine_messages_per_step']:17.2f} {s['chunk_messages_per_step']:16.2f} "
              f"{s['tokens_per_s']:8.0f} {s['engine_cpu_ms_per_1k_tokens']:21.1f} "
              f"{s['client_cpu_ms_per_1k_tokens']:21.1f}")
    ratios = {arm: {"engine_messages_per_step": summary[arm]["engine_messages_per_step"]
                    / base["engine_messages_per_step"],
                    "tokens_per_s": summary[arm]["tokens_per_s"] / base["tokens_per_s"],
                    "engine_cpu_per_token": summary[arm]["engine_cpu_ms_per_1k_tokens"]
                    / base["engine_cpu_ms_per_1k_tokens"]} for arm in ARMS[1:]}
    for arm, r in ratios.items():
        print(f"{arm} vs per_request: engine messages x{r['engine_messages_per_step']:.3f}, "
              f"tokens/s x{r['tokens_per_s']:.3f}, engine CPU per token x{r['engine_cpu_per_token']:.3f}")
    plot(summary, args)
    return {"runs": runs, "summary": summary, "ratios_to_per_request": ratios}


def plot(summary: dict, args) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = [summary[arm]["engine_messages_per_step"] for arm in ARMS]
    ax.bar(ARMS, values, color=["#999999", "#3a7", "#37a"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    ax.set_ylabel("NATS messages published per engine step")
    ax.set_title(f"{args.streams} concurrent streams, one engine")
    fig.tight_layout()
    out = Path(args.out).with_suffix(".png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (repeatable)")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chunk_batching.json"))
    args = parser.parse_args()
    write_results(args.out, args, aio.run(main_async(args)))


if __name__ == "__main__":
    main()
