"""The vLLM runner of bench/engine_realistic.py. It runs with the python of vLLM's own venv (vLLM is
not a Strata dependency and is never imported in Strata's venv) and speaks bench/runner_protocol.py.

The parent sets the environment: VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core in this process),
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache), VLLM_CPU_OMP_THREADS_BIND (the cores its OpenMP threads are
bound to: as many as the other runners' threads). Sampled requests carry no seed: vLLM's per-request
seeds fail on its CPU build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runner_protocol import StepClock, serve  # noqa: E402


class VllmRunner:
    def __init__(self, job: dict):
        from vllm import LLM

        missing = [v for v in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE",
                               "VLLM_CPU_OMP_THREADS_BIND") if v not in os.environ]
        if missing:
            raise RuntimeError(f"environment not set by the parent: {', '.join(missing)}")
        self.llm = LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"],
                       max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
                       max_model_len=job["max_model_len"], enable_prefix_caching=False, seed=0,
                       enforce_eager=job.get("vllm_enforce_eager", False))
        self.modes = job["modes"]
        self.warmup_prompts = job["warmup"]
        self.notes = ["sampled requests without per-request seeds (they fail on vLLM's CPU build)",
                      f"OpenMP threads bound to cores {os.environ['VLLM_CPU_OMP_THREADS_BIND']}"]

    def _params(self, mode: str, max_tokens: list[int]):
        from vllm import SamplingParams

        spec = dict(self.modes[mode])
        spec.pop("seed", None)  # see the module docstring
        return [SamplingParams(max_tokens=m, ignore_eos=True, **spec) for m in max_tokens]

    def _generate(self, prompts: list[list[int]], params):
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def warmup(self, mode: str) -> None:
        self._generate(self.warmup_prompts["prompts"], self._params(mode, self.warmup_prompts["max_tokens"]))

    def prepare(self, workload: dict, mode: str):
        prompts, params = workload["prompts"], self._params(mode, workload["max_tokens"])
        clock = StepClock(workload["decode_batch"]) if "decode_batch" in workload else None

        def generate():
            if clock is None:
                return self._generate(prompts, params)
            # LLMEngine.step takes each step's outputs from its engine core client's get_output;
            # their new token ids are the step's tokens.
            core = self.llm.llm_engine.engine_core
            get_output = core.get_output

            def timed_get_output():
                outputs = get_output()
                clock.record(sum(len(o.new_token_ids) for o in outputs.outputs))
                return outputs

            core.get_output = timed_get_output  # this run only: the instance attribute shadows the method
            try:
                return self._generate(prompts, params)
            finally:
                del core.get_output

        def account(outputs) -> dict:
            return {"output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                    "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                    **(clock.figures() if clock is not None else {})}

        return generate, account


def make_runner(name: str, job: dict) -> VllmRunner:
    if name != "vllm":
        raise ValueError(f"this script runs the vllm runner, not {name!r}")
    return VllmRunner(job)


if __name__ == "__main__":
    serve(make_runner)
