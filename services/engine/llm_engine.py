"""The engine: requests in, one scheduled batch per step, tokens out."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from services.engine.block_manager import BlockManager, KvEvents
from services.engine.choices import ChoiceGroup, check_resumable, fork
from services.engine.config import EngineArgs
from services.engine.input_processor import InputProcessor
from services.engine.model_config import ModelConfig
from services.engine.model_runner import STEP_PHASES, ModelRunner, StepTimings
from services.engine.output_processor import OutputProcessor
from services.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus
from services.engine.structured import StructuredOutputs, advance as advance_grammar
from shared.block_hash import adapter_root_hash


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class LLMEngine:
    """The step loop. detokenize=True (LLM, the thread core): step() returns text too, made
    by its own OutputProcessor right after each step; False (the core process): token ids only,
    the worker's OutputProcessor makes the text and ends choices on stop strings (stop_choice)."""

    def __init__(self, model_dir: str | Path, args: EngineArgs | None = None, streaming: bool = True,
                 detokenize: bool = True):
        self.args = args or EngineArgs()
        self.model_config = ModelConfig.load(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.runner = ModelRunner(self.model_config, self.args)
        self.block_manager = BlockManager(self.runner.num_blocks, self.args.block_size,
                                          self.args.enable_prefix_caching)
        self.lora = self.runner.lora  # LoRAManager, or None without enable_lora
        self.scheduler = Scheduler(self.block_manager, self.args.max_num_seqs, self.args.max_num_batched_tokens,
                                   lora=self.lora)
        self.spec = None  # speculative decoding (services.engine.spec_decode), when configured
        if self.args.speculative is not None:
            from services.engine.spec_decode import SpeculativeDecoder

            self.spec = SpeculativeDecoder(self.args.speculative, self.runner, self.block_manager, self.args,
                                           self.model_config, reserved_blocks=self.scheduler.watermark_blocks)
        # A sliding-window model attends to everything up to its window, so the context stops
        # there: the full attention here equals the model's own.
        self.max_model_len = min(self.args.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings,
                                 self.model_config.sliding_window or self.model_config.max_position_embeddings,
                                 self.runner.num_blocks * self.args.block_size)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                            self.model_config.eos_token_ids)
        self.runner.sampler.structured = self.structured
        self.inputs = InputProcessor(self.tokenizer, self.model_config, self.max_model_len,
                                     self.model_config.generation_defaults(self.args.generation_config),
                                     self.structured)
        # streaming=False (offline use): step() returns only ended choices, and text is decoded
        # once at the end unless stop strings need it incrementally.
        self.streaming = streaming
        self.outputs = OutputProcessor(self.tokenizer.backend_tokenizer, streaming) if detokenize else None
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.step_timings = StepTimings()  # every step so far, phase by phase
        self.last_step: StepTimings | None = None
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._aborted: list[RequestOutput] = []

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_name: str | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError and changes nothing if bad.
        `lora_name`: a registered LoRA adapter to run it with."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids, params = self.inputs.process(prompt, params)
        if lora_name is not None:
            self.acquire_lora(lora_name)
        self.add_processed(request_id, text, ids, params, arrival_time, lora_name=lora_name)

    def acquire_lora(self, name: str) -> None:
        """Pin a LoRA adapter (read into the host cache if it is not there) for a request that
        add_processed will queue; InvalidRequestError if it cannot serve."""
        from services.engine.lora import LoRAAdapterError

        if self.lora is None:
            raise InvalidRequestError(f"LoRA adapter {name!r} requested, but this engine serves no adapters "
                                      f"(engine argument enable_lora)", "model")
        try:
            self.lora.acquire(name)
        except LoRAAdapterError as exc:
            raise InvalidRequestError(str(exc), "model") from None

    def add_processed(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None, resumed: tuple[int, int] = (0, 0),
                      lora_name: str | None = None) -> None:
        """Queue a request already validated by self.inputs (the async engine validates off-loop).

        resumed=(generated, text_chars): the continuation of a stream another replica started
        (protocol.Resume): the last `generated` ids are its completion so far, of which
        `text_chars` characters of text were delivered; max_tokens is the whole stream's (the
        generated tokens count against it).
        lora_name: its adapter, already pinned by acquire_lora (released when it ends)."""
        if request_id in self.requests:
            if lora_name is not None:
                self.lora.release(lora_name)
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        params = params.resolved(self.inputs.generation_defaults)  # a no-op once processed
        generated, text_chars = resumed
        try:
            check_resumable(params, generated)
        except InvalidRequestError:
            if lora_name is not None:
                self.lora.release(lora_name)
            raise
        prompt_ids = ids[:len(ids) - generated]
        if generated and params.prompt_logprobs is not None:  # delivered by the stream's first leg
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        processors = self.inputs.logits_processors(params)  # (its choices share them)

        def new_seq(params: SamplingParams) -> Sequence:
            seq = Sequence(request_id, prompt_ids, params, text, arrival_time)
            if params.structured is not None:  # compiled already (InputProcessor): a cache hit
                # Each choice its own matcher; a resumed stream's in the state its delivered tokens left it.
                seq.grammar = self.structured.matcher(params.structured, ids[len(prompt_ids):])
            if lora_name is not None:
                seq.lora_name, seq.hash_root = lora_name, adapter_root_hash(lora_name)
            seq.processors = processors
            return seq

        try:
            seq = new_seq(params)
            if params.n > 1:  # the other choices are forked from it after its prefill
                ChoiceGroup(seq, params.n, new_seq)
        except InvalidRequestError:
            if lora_name is not None:
                self.lora.release(lora_name)
            raise
        if generated:
            self._resume(seq, ids[len(prompt_ids):])
        if self.outputs is not None:  # the text the caller has not received yet is still to come
            self.outputs.add(request_id, prompt_ids, params, ids[len(prompt_ids):], text_chars)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    @staticmethod
    def _resume(seq: Sequence, generated: list[int]) -> None:
        """Make seq what it was on the replica that lost it: the same output tokens (so penalties,
        max_tokens and usage count them) and its seeded draws continuing at the next position.
        The re-prefill recomputes their KV like a preempted sequence's."""
        seq.token_ids.extend(generated)
        seq.num_emitted_tokens = len(generated)
        seq.logprobs = [{} for _ in generated]  # keeps later tokens' logprobs aligned; never emitted
        # Seeded draws are keyed on (seed, output position): nothing to replay.

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        now = time.monotonic()
        for choice in seq.group.seqs if seq.group is not None else [seq]:
            if not choice.is_finished:
                self._finish(choice, "abort")
                choice.finish_time = now
                self._aborted.append(self._output(choice))
        return True

    def stop_choice(self, request_id: str, index: int = 0) -> None:
        """End one choice that a stop string ended in the OutputProcessor (which made its final
        output): its blocks are freed now; a choice already ended is left as it is."""
        seq = self.requests.get(request_id)
        if seq is None:
            return
        choice = seq.group.seqs[index] if seq.group is not None else seq
        if not choice.is_finished:
            if choice.group is not None:
                choice.group.final_outputs += 1  # made by the OutputProcessor
            self._finish_request(choice, "stop", time.monotonic())

    def discard_pending_outputs(self) -> None:
        if self.outputs is not None:
            for out in self._aborted:
                self.outputs.discard(out.request_id)
        self._aborted = []

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or aborted ones whose final output is not out yet."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One batch through the model. Its phases go to `last_step` (None for a step with no
        batch) and add up into `step_timings`."""
        outputs = self._step()
        if self.outputs is None:
            return outputs
        processor = self.outputs
        processor.busy_s = 0.0
        # Offline, only ended choices (a stop string's request streams here to be checked).
        outputs = [p for p in map(processor.process, outputs)
                   if p is not None and (self.streaming or p.outputs[0].finish_reason is not None)]
        for request_id, index in processor.take_stopped():
            self.stop_choice(request_id, index)  # before the next step: it never runs again
        if self.last_step is not None:
            for timings in (self.last_step, self.step_timings):
                timings.detokenize += processor.busy_s
                timings.wall += processor.busy_s
        return outputs

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self.last_step = None
        outputs, self._aborted = self._aborted, []
        if self.lora is not None:  # unloaded adapters: their cached KV must not outlive them
            for root in self.lora.take_retired():
                self.block_manager.drop_chain(root)
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        timings = StepTimings(steps=1)
        timings.schedule = time.perf_counter() - start
        if self.spec is not None:
            self.spec.propose(batch, self.max_model_len)
            timings.propose = time.perf_counter() - start - timings.schedule
        if self.args.debug_step_delay_s:  # lands in `other`: no named phase owns it
            time.sleep(self.args.debug_step_delay_s)
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        sampled_seqs, result = self.runner.execute(batch, timings)
        executed = time.perf_counter()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - len(seq.spec_token_ids)  # drafts count once accepted
            self.block_manager.cache_full_blocks(seq)
            if seq.group is not None and seq.group.ready_to_fork(seq):  # before its first token
                fork(seq.group, self.scheduler, self.runner.copy_block)
        now = time.monotonic()
        generated, previous = 0, None
        for seq, token, logprob in zip(sampled_seqs, result.token_ids, result.logprobs):
            if seq.is_finished:  # a speculated run that stopped before its last token
                continue
            if seq is previous:  # the token before was an accepted draft: the verification computed its KV
                seq.num_computed_tokens += 1
                self.block_manager.cache_full_blocks(seq)
            if seq.params.max_tokens == 0:  # prefill only (for its prompt logprobs): no token
                self._finish_request(seq, "length", now)
                continue
            self._append_token(seq, token, logprob, now)
            generated, previous = generated + 1, seq
        if self.spec is not None:
            self.spec.verified(batch)
        for seq in dict.fromkeys(sampled_seqs):  # a sequence may have had several tokens
            if self.streaming or seq.is_finished or seq.params.stop:  # stop strings: checked by self.outputs
                outputs.append(self._output(seq))
        self.num_steps += 1
        self.num_generated_tokens += generated
        end = time.perf_counter()
        timings.bookkeeping = end - executed
        timings.wall = end - start
        named = (timings.schedule + timings.propose + timings.prepare + timings.forward + timings.sample
                 + timings.detokenize + timings.bookkeeping)
        timings.other = max(timings.wall - named, 0.0)
        self.last_step = timings
        self.step_timings.add(timings)
        if self.spec is not None:
            self.spec.observe(timings.wall)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob, now: float) -> None:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            chosen, top = logprob
            seq.logprobs.append({**top, token: chosen})
        params = seq.params
        reason = None
        if seq.grammar is not None:
            reason = advance_grammar(seq, token)  # "stop" once the grammar has ended
        if reason is None:
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            self._finish_request(seq, reason, now)

    def _finish_request(self, seq: Sequence, reason: str, now: float) -> None:
        self._finish(seq, reason)
        seq.finish_time = now
        if seq.first_token_time is None:  # prefill only: its end is where a first token would be
            seq.first_token_time = now
        if seq.group is None or seq.group.finished:
            del self.requests[seq.request_id]

    def _finish(self, seq: Sequence, reason: str) -> None:
        group = seq.group
        if group is not None and seq.index and not group.forked:  # never scheduled: it holds nothing
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        else:
            self.scheduler.finish(seq, reason)
        if seq.lora_name is not None and (group is None or group.finished):  # pinned once per request
            self.lora.release(seq.lora_name)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        new_ids = seq.output_token_ids[seq.num_emitted_tokens:]
        new_logprobs = [(t, lp[t], lp) for t, lp in zip(new_ids, seq.logprobs[seq.num_emitted_tokens:])] \
            if seq.params.logprobs is not None else []
        seq.num_emitted_tokens = seq.num_output_tokens
        group, choices_running = seq.group, 0
        if group is not None:
            group.final_outputs += finished
            choices_running = group.n - group.final_outputs
        # The whole completion once it ended (the text is an OutputProcessor's to make).
        completion = CompletionOutput(seq.index, "", seq.output_token_ids if finished else [], seq.finish_reason,
                                      list(seq.logprobs) if finished and seq.params.logprobs is not None else None)
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finish_time,
                                 seq.num_draft_tokens, seq.num_accepted_tokens)
        first = group.seqs[0] if group is not None else seq  # the prompt's, counted once
        return RequestOutput(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], [completion],
                             finished and not choices_running, max(first.num_cached_tokens, 0), new_ids, "",
                             new_logprobs, metrics, choices_running,
                             group.num_output_tokens() if group is not None else seq.num_output_tokens,
                             list(first.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)

    # ---- introspection ----------------------------------------------------------------------
    def drain_kv_events(self) -> KvEvents:
        return self.block_manager.drain_events()

    def stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        return {
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
            "quantization": self.runner.quantization.name, "kv_cache_dtype": self.runner.kv_cache_dtype,
            "used_blocks": bm.num_used_blocks,
            "cached_blocks": len(bm.cached),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "num_steps": self.num_steps,
            "max_model_len": self.max_model_len, "vocab_size": self.model_config.vocab_size,  # effective limits
            "generated_tokens": self.num_generated_tokens,
            **{f"step_{phase}_s": getattr(self.step_timings, phase) for phase in STEP_PHASES},
            "step_wall_s": self.step_timings.wall,
            **(self.spec.snapshot() if self.spec is not None else {}),
            **(self._lora_stats() if self.lora is not None else {}),
        }

    def _lora_stats(self) -> dict:
        """vLLM's lora_requests_info: adapters of running and waiting requests; and the caches."""
        sched = self.scheduler
        return {**self.lora.stats(), "max_loras": self.lora.max_loras, "max_lora_rank": self.lora.max_lora_rank,
                "lora_running": sorted({s.lora_name for s in sched.running if s.lora_name is not None}),
                "lora_waiting": sorted({s.lora_name for s in list(sched.waiting) if s.lora_name is not None})}
