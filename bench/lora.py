"""LoRA adapters: the runtime cost of serving many adapters in one batch, routing and packing
across a fleet, and the placement policy at scale in the simulator.

1. runtime: throughput at batch 32 with the requests spread over 8 adapters (rank 16 on every
   projection) vs the base model alone, same engine settings, same prompts, runs interleaved.
   CPU, bf16, on the realistic M shape (a 56M Llama, vocab 32k; --shape S for the tiny model).
2. fleet: the local stack (3 engines on the tiny model, one torch thread each, max_loras 4),
   24 adapters loaded over HTTP, Zipf-skewed demand; adapter loads (device-slot fills, summed
   over the engines' /metrics) and TTFT p50 with adapter-aware routing + packing (kv_aware)
   vs round_robin.
3. simulator: services.scaler.lora_simulator at 100 replicas and 1,000 adapters.

Adapters are written in PEFT's format (adapter_config.json + adapter_model.safetensors) with
random weights. Writes bench/results/lora.json and lora.png.

    python bench/lora.py [--parts runtime,fleet,sim] [--shape M]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import percentile, pyplot, write_results  # noqa: E402
from services.engine.lora.adapter import MODULE_SLICES, module_shape  # noqa: E402
from services.engine.model_config import ModelConfig  # noqa: E402

ALL_MODULES = list(MODULE_SLICES)


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int, modules=ALL_MODULES) -> Path:
    """A PEFT-format LoRA adapter with random weights for the model in model_dir."""
    from safetensors.torch import save_file

    config = ModelConfig.load(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in modules:
            fan_in, fan_out = module_shape(config, module)
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none",
        "base_model_name_or_path": str(model_dir)}))
    return out


# ---- 1. runtime ------------------------------------------------------------------------------
def bench_runtime(args, workdir: Path) -> dict:
    from services.engine import LLM, LoRARequest, SamplingParams
    from shared import realistic_models

    model_dir = realistic_models.ensure_model(args.shape)
    config = ModelConfig.load(model_dir)
    adapters = [LoRARequest(f"a{i}", str(write_adapter(model_dir, workdir / f"rt-{i}", 16, i))) for i in range(8)]
    rng = random.Random(0)
    prompts = [[rng.randrange(8, config.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    common = dict(max_num_seqs=args.batch, enable_prefix_caching=False, num_kv_blocks=args.batch * 16)
    base = LLM(model_dir, **common)
    lora = LLM(model_dir, enable_lora=True, max_loras=8, max_lora_rank=16, **common)
    spread = [adapters[i % 8] for i in range(args.batch)]
    arms = {"base": lambda: base.generate(prompts, params),
            "lora_8_adapters": lambda: lora.generate(prompts, params, lora_request=spread),
            "lora_engine_base_requests": lambda: lora.generate(prompts, params)}
    for run in arms.values():  # warm up (C kernels, oneDNN)
        run()
    times = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, run in arms.items():
            start = time.perf_counter()
            outs = run()
            times[name].append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.output_tokens for o in outs)
    tokens = args.batch * args.output_tokens
    res = {name: {"seconds_best": min(t), "output_tok_s": tokens / min(t)} for name, t in times.items()}
    res["ratio_lora_vs_base"] = res["lora_8_adapters"]["output_tok_s"] / res["base"]["output_tok_s"]
    res["ratio_lora_engine_base_requests_vs_base"] = (res["lora_engine_base_requests"]["output_tok_s"]
                                                      / res["base"]["output_tok_s"])
    res.update(shape=args.shape, dtype=str(base.engine.runner.dtype), batch=args.batch, adapters=8, rank=16,
               device="cpu", gpu="not measured (no GPU on this machine)")
    print(f"runtime ({args.shape}, {res['dtype']}, batch {args.batch}): base {res['base']['output_tok_s']:.0f} tok/s, "
          f"8 adapters {res['lora_8_adapters']['output_tok_s']:.0f} tok/s = {res['ratio_lora_vs_base']:.2f}x "
          f"(target >= 0.7); LoRA engine on base requests {res['ratio_lora_engine_base_requests_vs_base']:.2f}x",
          flush=True)
    return res


# ---- 2. fleet --------------------------------------------------------------------------------
async def _fleet_run(policy: str, model_dir: Path, adapter_dirs: list[Path], args) -> dict:
    import aiohttp
    import redis as sync_redis

    from shared import keys
    from shared.localstack import LocalStack

    flags = ["--threads", "1", "--num-kv-blocks", "512", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "8",
             "--max-cpu-loras", "24", "--log-level", "warning"]
    with LocalStack(str(model_dir), engines=3, deployment="tiny", engine_args=flags,
                    scheduler_args=["--policy", policy, "--log-level", "warning"],
                    gateway_args=["--log-level", "warning"]) as stack:
        headers = {"Authorization": f"Bearer {stack.api_key}"}
        async with aiohttp.ClientSession() as http:
            for i, path in enumerate(adapter_dirs):
                async with http.post(stack.base_url + "/v1/load_lora_adapter", headers=headers,
                                     json={"lora_name": f"ad{i}", "lora_path": str(path)}) as resp:
                    assert resp.status == 200, await resp.text()
            await asyncio.sleep(2.0)  # every engine registered them, the scheduler heard every replica
            rng = random.Random(args.seed)
            weights = [1 / (i + 1) ** args.zipf for i in range(len(adapter_dirs))]
            work = [(f"tiny:ad{rng.choices(range(len(adapter_dirs)), weights)[0]}",
                     [rng.randrange(8, 4000) for _ in range(args.fleet_prompt_tokens)]) for _ in range(args.requests)]
            ttfts: list[float] = []
            sem = asyncio.Semaphore(args.concurrency)

            async def one(model, prompt):
                async with sem:
                    body = {"model": model, "prompt": prompt, "max_tokens": args.fleet_output_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True}
                    start = time.perf_counter()
                    async with http.post(stack.base_url + "/v1/completions", json=body, headers=headers) as resp:
                        assert resp.status == 200, await resp.text()
                        first = None
                        async for line in resp.content:
                            if first is None and line.startswith(b"data: {"):
                                first = time.perf_counter() - start
                    ttfts.append(first)

            start = time.perf_counter()
            await asyncio.gather(*(one(m, p) for m, p in work))
            elapsed = time.perf_counter() - start
            client = sync_redis.Redis.from_url(stack.infra.redis_url)
            urls = [client.hget(keys.replica(f"engine-{i}"), "http_url").decode() for i in range(3)]
            client.close()
            loads = evictions = 0
            for url in urls:
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                for line in text.splitlines():
                    if line.startswith("strata:lora_adapter_loads_total"):
                        loads += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("strata:lora_adapter_evictions_total"):
                        evictions += float(line.rsplit(" ", 1)[1])
    return {"requests": len(ttfts), "adapter_loads": int(loads), "adapter_evictions": int(evictions),
            "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3, "ttft_p90_ms": percentile(ttfts, 0.9) * 1e3,
            "seconds": elapsed, "throughput_req_s": len(ttfts) / elapsed}


def bench_fleet(args, workdir: Path) -> dict:
    from shared import aio
    from shared.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path.home() / ".strata" / "models" / "tiny-llama")
    adapter_dirs = [write_adapter(model_dir, workdir / f"fleet-{i}", 8, 100 + i) for i in range(24)]
    out = {}
    for policy in ("kv_aware", "round_robin"):
        out[policy] = r = aio.run(_fleet_run(policy, model_dir, adapter_dirs, args))
        print(f"fleet {policy:12s} adapter loads {r['adapter_loads']:4d}  TTFT p50 {r['ttft_p50_ms']:.0f} ms "
              f"p90 {r['ttft_p90_ms']:.0f} ms  {r['throughput_req_s']:.1f} req/s", flush=True)
    out["loads_ratio_aware_vs_round_robin"] = out["kv_aware"]["adapter_loads"] / max(out["round_robin"]["adapter_loads"], 1)
    out["ttft_p50_ratio_aware_vs_round_robin"] = out["kv_aware"]["ttft_p50_ms"] / out["round_robin"]["ttft_p50_ms"]
    out["setup"] = {"engines": 3, "adapters": 24, "max_loras": 4, "zipf": args.zipf, "model": "tiny (S)"}
    return out


# ---- 3. simulator ----------------------------------------------------------------------------
def bench_sim(args) -> dict:
    from services.scaler.lora_simulator import LoraFleet, compare

    out = compare(LoraFleet(replicas=100, adapters=1000, duration_s=args.sim_duration))
    for r in out["results"].values():
        print(f"sim {r['policy']:12s} loads {r['adapter_loads']:6d} ({r['loads_per_1k_requests']:.0f}/1k requests) "
              f"TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms ({r['wall_s']:.0f} s to simulate)",
              flush=True)
    return out


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if "runtime" in data:
        rt = data["runtime"]
        names = ["base", "lora_8_adapters", "lora_engine_base_requests"]
        axes[0].bar(["base", "8 adapters", "LoRA engine,\nbase requests"], [rt[n]["output_tok_s"] for n in names],
                    color=["#4c72b0", "#dd8452", "#55a868"])
        axes[0].set_ylabel("output tokens/s")
        axes[0].set_title(f"runtime: batch {rt['batch']}, {rt['shape']} {rt['dtype'].replace('torch.', '')}, CPU "
                          f"({rt['ratio_lora_vs_base']:.2f}x)")
    if "fleet" in data:
        fl = data["fleet"]
        pols = ["kv_aware", "round_robin"]
        ax = axes[1]
        ax.bar([0, 1], [fl[p]["adapter_loads"] for p in pols], 0.4, label="adapter loads", color="#4c72b0")
        ax2 = ax.twinx()
        ax2.bar([0.4, 1.4], [fl[p]["ttft_p50_ms"] for p in pols], 0.4, label="TTFT p50 (ms)", color="#dd8452")
        ax.set_xticks([0.2, 1.2], ["adapter-aware + packing", "round_robin"])
        ax.set_ylabel("adapter loads")
        ax2.set_ylabel("TTFT p50 (ms)")
        ax.set_title("fleet: 3 engines, 24 adapters, max_loras 4")
    if "sim" in data:
        res = data["sim"]["results"]
        pols = list(res)
        axes[2].bar(pols, [res[p]["loads_per_1k_requests"] for p in pols], color="#4c72b0")
        axes[2].set_ylabel("adapter loads per 1k requests")
        axes[2].set_title("simulator: 100 replicas, 1,000 adapters\n" + ", ".join(
            f"{p} p50 {res[p]['ttft_p50_ms']:.0f} ms" for p in pols), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="runtime,fleet,sim")
    p.add_argument("--shape", default="M", help="realistic shape for the runtime part (S: the tiny model)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=720, help="fleet requests")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--zipf", type=float, default=1.2, help="demand over the 24 adapters ~ 1/rank^zipf")
    p.add_argument("--fleet-prompt-tokens", type=int, default=64)
    p.add_argument("--fleet-output-tokens", type=int, default=16)
    p.add_argument("--sim-duration", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora.json"))
    args = p.parse_args()
    import tempfile

    parts = set(args.parts.split(","))
    data = {}
    with tempfile.TemporaryDirectory(prefix="strata-lora-bench-") as tmp:
        if "runtime" in parts:
            data["runtime"] = bench_runtime(args, Path(tmp))
        if "fleet" in parts:
            data["fleet"] = bench_fleet(args, Path(tmp))
        if "sim" in parts:
            data["sim"] = bench_sim(args)
    write_results(args.out, args, data)
    plot(data, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
