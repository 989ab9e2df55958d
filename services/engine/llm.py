"""Offline API, in the style of vLLM: `LLM(model_dir, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from pathlib import Path

from services.engine.config import EngineArgs
from services.engine.llm_engine import LLMEngine
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
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        # Validate everything first, so a bad prompt leaves nothing half-queued.
        processed = [self.engine.inputs.process(p, sp) for p, sp in zip(prompts, sampling_params)]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, (text, tokens, sp) in zip(ids, processed):
            self.engine.add_processed(rid, text, tokens, sp)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[rid] for rid in ids]

    def stats(self) -> dict:
        return self.engine.stats()
