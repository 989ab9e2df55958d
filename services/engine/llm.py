"""Offline API, in the style of vLLM: `LLM(model_dir, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from pathlib import Path

from services.engine.config import EngineArgs
from services.engine.llm_engine import LLMEngine
from services.engine.lora import LoRARequest
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path, **engine_args):
        self.engine = LLMEngine(model, EngineArgs.from_kwargs(**engine_args), streaming=False)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(lora_request)} LoRA requests for {len(prompts)} prompts")
        # Validate everything first, so a bad prompt leaves nothing half-queued.
        processed = [self.engine.inputs.process(p, sp) for p, sp in zip(prompts, sampling_params)]
        for lora in {r for r in lora_request if r is not None}:
            self.register_lora(lora)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, (text, tokens, sp), lora in zip(ids, processed, lora_request):
            if lora is not None:
                self.engine.acquire_lora(lora.lora_name)
            self.engine.add_processed(rid, text, tokens, sp, lora_name=lora.lora_name if lora else None)
        finished: dict[str, RequestOutput] = {}
        choices: dict[str, list] = {}  # request id -> its finished choices (n > 1)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                choices.setdefault(out.request_id, []).extend(out.outputs)
                if out.finished:
                    out.outputs = sorted(choices.pop(out.request_id), key=lambda c: c.index)
                    finished[out.request_id] = out
        return [finished[rid] for rid in ids]

    def register_lora(self, lora: LoRARequest) -> None:
        """Serve an adapter (LoRAAdapterError if it cannot serve on this model)."""
        if self.engine.lora is None:
            raise ValueError("LoRA adapters need the engine argument enable_lora=True")
        self.engine.lora.register(lora.lora_name, lora.lora_path)

    def stats(self) -> dict:
        return self.engine.stats()
