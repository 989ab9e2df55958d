"""The Strata and Hugging Face runners of bench/engine_realistic.py (Strata's venv), speaking
bench/runner_protocol.py:

  strata     the offline `LLM` (services.engine): all requests at once, continuous batching
  hf-static  transformers `generate` in static batches of max_num_seqs, left-padded; a batch runs until
             its longest request is done (only the tokens each request asked for count)
  hf-cb      transformers' own continuous batching (the manager behind `generate_batch`), every request
             with its own max_new_tokens
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.runner_protocol import StepClock, serve  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    from services.engine.model_config import ModelConfig

    cfg = ModelConfig.load(model_dir)
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPES[dtype].itemsize


class StrataRunner:
    def __init__(self, job: dict):
        from services.engine import LLM

        block_size = 16
        # The KV budget in blocks, as the other runners get it (Strata's own sizing reads free memory).
        blocks = (job["kv_cache_gib"] << 30) // (block_size * kv_bytes_per_token(job["model"], job["dtype"]))
        self.llm = LLM(job["model"], device=job["device"], max_num_seqs=job["max_num_seqs"],
                       max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
                       enable_prefix_caching=False, dtype=job["dtype"], num_threads=job["threads"],
                       block_size=block_size, num_kv_blocks=blocks, sampler_backend=job["sampler_backend"])
        self.modes, self.warmup_prompts = job["modes"], job["warmup"]
        self.notes = [f"{blocks * block_size} KV tokens"]

    def _params(self, mode: str, max_tokens: list[int]):
        from services.engine import SamplingParams

        spec = dict(self.modes[mode])
        seed = spec.pop("seed", None)
        return [SamplingParams(max_tokens=m, ignore_eos=True, seed=None if seed is None else seed + i, **spec)
                for i, m in enumerate(max_tokens)]

    def warmup(self, mode: str) -> None:
        self.llm.generate(self.warmup_prompts["prompts"], self._params(mode, self.warmup_prompts["max_tokens"]))

    def prepare(self, workload: dict, mode: str):
        prompts, params = workload["prompts"], self._params(mode, workload["max_tokens"])
        before = self.llm.stats()
        clock = StepClock(workload["decode_batch"]) if "decode_batch" in workload else None
        step_phases: list = []  # each step's StepTimings, beside the clock's entries

        def generate():
            if clock is None:
                return self.llm.generate(prompts, params)
            engine = self.llm.engine
            step = engine.step

            def timed_step():
                tokens = engine.num_generated_tokens
                outputs = step()
                clock.record(engine.num_generated_tokens - tokens)
                step_phases.append(engine.last_step)
                return outputs

            engine.step = timed_step  # this run only: the instance attribute shadows the method
            try:
                return self.llm.generate(prompts, params)
            finally:
                del engine.step

        def account(outputs) -> dict:
            after = self.llm.stats()
            phases = {k[len("step_"):-len("_s")]: after[k] - before[k]
                      for k in after if k.startswith("step_") and k.endswith("_s")}
            answer = {"output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                      "prompt_tokens": sum(len(p) for p in prompts),
                      "steps": after["num_steps"] - before["num_steps"],
                      "preemptions": after["num_preemptions"] - before["num_preemptions"],
                      "phases_s": phases}
            if clock is not None:
                from services.engine.model_runner import StepTimings

                first, last = clock.window()
                window = StepTimings()
                for step in step_phases[first + 1:last + 1]:
                    if step is not None:  # a step with no batch
                        window.add(step)
                answer.update(clock.figures(), decode_phases_s={name: getattr(window, name) for name in phases})
            return answer

        return generate, account


class HfRunner:
    """hf-static and hf-cb share this class; each runs in its own process."""

    def __init__(self, name: str, job: dict):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(job["threads"])
        self.name, self.job, self.device = name, job, torch.device(job["device"])
        self.model = AutoModelForCausalLM.from_pretrained(job["model"], local_files_only=True,
                                                          dtype=DTYPES[job["dtype"]]).to(self.device).eval()
        self.model.generation_config.eos_token_id = None  # every request ignores EOS
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.modes, self.warmup_prompts = job["modes"], job["warmup"]
        self.batch = job["max_num_seqs"]
        self._cb = contextlib.ExitStack()
        self._cb_manager, self._cb_mode = None, None
        if name == "hf-static":
            self.notes = ["one seed per static batch (generate has no per-row seeds)"]
        else:
            self.notes = ["repetition_penalty not applied: transformers' continuous batching does not support "
                          "RepetitionPenaltyLogitsProcessor (it drops it)", "one seed for all requests of a mode"]

    def _sampling(self, mode: str) -> dict:
        spec = dict(self.modes[mode])
        spec.pop("seed", None)
        if spec.get("temperature", 1.0) == 0.0:
            return {"do_sample": False}
        return {"do_sample": True, **spec}

    # ------------------------------------------------------------ hf-static

    @torch.inference_mode()
    def _static(self, prompts: list[list[int]], max_tokens: list[int], mode: str,
                clock: StepClock | None = None) -> int:
        seed, sampling = self.modes[mode].get("seed"), self._sampling(mode)
        useful = 0
        for start in range(0, len(prompts), self.batch):
            batch, wants = prompts[start:start + self.batch], max_tokens[start:start + self.batch]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), self.pad_id)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            if seed is not None:
                torch.manual_seed(seed + start)
            longest = max(wants)
            streamer = StepStreamer(clock) if clock is not None else None
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=longest,
                                      pad_token_id=self.pad_id, streamer=streamer, **sampling)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the timed call ends when the device is done
            if out.shape[1] != width + longest:
                raise RuntimeError(f"generate stopped after {out.shape[1] - width} of {longest} tokens")
            useful += sum(wants)
        return useful

    # ------------------------------------------------------------ hf-cb

    def _open_cb(self, mode: str):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if self._cb_mode == mode:
            return self._cb_manager
        self._cb.close()
        sampling = self._sampling(mode)
        sampling.pop("repetition_penalty", None)  # unsupported, see notes
        config = GenerationConfig(max_new_tokens=16, eos_token_id=-1, pad_token_id=self.pad_id, **sampling)
        page = 256
        kv_tokens = (self.job["kv_cache_gib"] << 30) // kv_bytes_per_token(self.job["model"], self.job["dtype"])
        cb_config = ContinuousBatchingConfig(
            page_size=page, num_blocks=max(1, kv_tokens // page), max_batch_tokens=self.job["max_num_batched_tokens"],
            max_requests_per_batch=self.batch, use_cuda_graph=False, seed=self.modes[mode].get("seed"),
            allow_block_sharing=False)  # no prefix caching, as for the other runners
        self._cb_manager = self._cb.enter_context(self.model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, block=True, timeout=30))
        self._cb_mode = mode
        return self._cb_manager

    def _continuous(self, prompts: list[list[int]], max_tokens: list[int], mode: str,
                    clock: StepClock | None = None) -> int:
        manager = self._open_cb(mode)
        ids = [manager.add_request(p, max_new_tokens=m, record_timestamps=clock is not None)
               for p, m in zip(prompts, max_tokens)]
        done: dict[str, int] = {}
        stamps: dict[str, list[float]] = {}
        deadline = time.monotonic() + self.job["run_timeout_s"]
        while len(done) < len(ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids) - len(done)} of {len(ids)} requests unfinished")
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                done[result.request_id] = len(result.generated_tokens)
                stamps[result.request_id] = result.timestamps or []
        if clock is not None:
            clock.record_requests([stamps[i] for i in ids])
        return sum(done[i] for i in ids)

    # ------------------------------------------------------------ protocol

    def _run(self, prompts, max_tokens, mode, clock: StepClock | None = None) -> int:
        return (self._static if self.name == "hf-static" else self._continuous)(prompts, max_tokens, mode, clock)

    def warmup(self, mode: str) -> None:
        self._run(self.warmup_prompts["prompts"], self.warmup_prompts["max_tokens"], mode)

    def prepare(self, workload: dict, mode: str):
        prompts, max_tokens = workload["prompts"], workload["max_tokens"]
        clock = StepClock(workload["decode_batch"]) if "decode_batch" in workload else None

        def account(output_tokens: int) -> dict:
            if output_tokens != sum(max_tokens):
                raise RuntimeError(f"{output_tokens} tokens generated, {sum(max_tokens)} asked for")
            return {"output_tokens": output_tokens, "prompt_tokens": sum(len(p) for p in prompts),
                    **(clock.figures() if clock is not None else {})}

        return (lambda: self._run(prompts, max_tokens, mode, clock)), account


class StepStreamer:
    """transformers' streamer protocol: `put` gets the prompt, then each step's new tokens."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 1:  # one token per row: a step (the prompt comes first, 2-D)
            self.clock.record(value.numel())

    def end(self) -> None:
        pass


def make_runner(name: str, job: dict):
    if name == "strata":
        return StrataRunner(job)
    if name in ("hf-static", "hf-cb"):
        return HfRunner(name, job)
    raise ValueError(f"unknown runner {name!r} (strata, hf-static, hf-cb)")


if __name__ == "__main__":
    serve(make_runner)
