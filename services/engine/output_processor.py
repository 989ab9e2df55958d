"""Text out of token ids, outside the step loop: incremental detokenization and stop strings.

The step loop (LLMEngine) hands out token ids, logprobs and the finish reasons it owns (EOS, stop
token ids, max_tokens, the context length, a grammar's end, abort). The OutputProcessor turns each
of its RequestOutputs into the caller's: the text delta, the whole text, and stop strings, which
end a choice at the token that completes one (its later tokens dropped, the text cut there)
and ask the step loop to stop it (take_stopped). As in vLLM v1, it runs where the caller is: in
the worker process, beside a core in a process of its own (services.engine.core_client), where a
stopped sequence may run one more step before the stop reaches the core; in-process
(LLMEngine with detokenize=True, for LLM and the thread core) right after the step, before the
next one.

It also owns what a caller sees of a request's choices: which have ended, whether the request
has, and its usage, so that a choice it ended on a stop string stays ended whatever the core
sends for it later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import SamplingParams


@dataclass
class _Choice:
    token_ids: list[int]  # prompt + output so far (the detokenizer reads the prompt's tail)
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] = field(default_factory=list)
    ended: bool = False


class _Request:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, streaming: bool):
        self.prompt_ids = prompt_ids
        self.params = params
        # Text incrementally when a stop string may end it or a caller streams it; else once at the end.
        self.incremental = bool(params.stop) or streaming
        self.choices: dict[int, _Choice] = {}
        self.num_ended = 0
        self.num_completion_tokens = 0  # of the ended choices

    def choice(self, index: int, tokenizer) -> _Choice:
        choice = self.choices.get(index)
        if choice is None:
            p = self.params
            choice = self.choices[index] = _Choice(list(self.prompt_ids), IncrementalDetokenizer(
                tokenizer, self.prompt_ids, p.stop, p.skip_special_tokens, p.include_stop_str_in_output))
        return choice


class OutputProcessor:
    """`tokenizer`: the tokenizers.Tokenizer (a transformers tokenizer's backend_tokenizer).
    streaming=False (offline use): text is decoded once at the end unless stop strings need it
    incrementally."""

    def __init__(self, tokenizer, streaming: bool = True):
        self.tokenizer = tokenizer
        self.streaming = streaming
        self._requests: dict[str, _Request] = {}
        self._stopped: list[tuple[str, int]] = []
        self.busy_s = 0.0  # time spent in process(), summed (callers read and reset it)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            generated: list[int] = (), text_chars: int = 0) -> None:
        """A request the step loop was given. generated/text_chars: a resumed stream's completion
        so far and how many characters of its text were delivered (protocol.Resume)."""
        request = self._requests[request_id] = _Request(list(prompt_ids), params, self.streaming)
        if generated:
            choice = request.choice(0, self.tokenizer)
            choice.token_ids.extend(generated)
            choice.logprobs = [{} for _ in generated]  # keeps later logprobs aligned; never emitted
            if request.incremental:
                choice.detokenizer.append(choice.token_ids)
                choice.detokenizer.sent_offset = text_chars  # may exceed the text while a character is incomplete

    def discard(self, request_id: str) -> None:
        """Forget a request that ended without a final output (a failed step, a dead core)."""
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        self._requests.clear()
        self._stopped.clear()

    def take_stopped(self) -> list[tuple[str, int]]:
        """(request id, choice index) of the choices a stop string ended since the last call,
        still running in the step loop: the caller stops them there (LLMEngine.stop_choice)."""
        stopped, self._stopped = self._stopped, []
        return stopped

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """The caller's output for one of the step loop's, or None when there is none: the
        request or the choice already ended here (on a stop string the core had not seen yet)."""
        start = time.perf_counter()
        try:
            return self._process(out)
        finally:
            self.busy_s += time.perf_counter() - start

    def _process(self, out: RequestOutput) -> RequestOutput | None:
        request = self._requests.get(out.request_id)
        if request is None:
            return None
        core = out.outputs[0]
        choice = request.choice(core.index, self.tokenizer)
        if choice.ended:
            return None
        params = request.params
        finish_reason = core.finish_reason
        new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
        if request.incremental:
            num_prompt = len(request.prompt_ids)
            for i, token in enumerate(new_ids):
                choice.token_ids.append(token)
                if new_logprobs:
                    choice.logprobs.append(new_logprobs[i][2])
                check_stop = len(choice.token_ids) - num_prompt >= params.min_tokens
                if choice.detokenizer.append(choice.token_ids, check_stop):
                    if finish_reason is None:  # the step loop still runs it
                        self._stopped.append((out.request_id, core.index))
                    new_ids, new_logprobs = new_ids[:i + 1], new_logprobs[:i + 1]
                    finish_reason = "stop"
                    break
        ended = finish_reason is not None
        detok = choice.detokenizer
        if ended:
            if not request.incremental:
                detok.output_text = self.tokenizer.decode(core.token_ids, skip_special_tokens=params.skip_special_tokens)
            else:  # text held back for an incomplete character: as the tokenizer decodes it
                detok.flush(choice.token_ids)
        delta = detok.take_delta(ended)
        if request.incremental:
            token_ids = choice.token_ids[len(request.prompt_ids):]
            logprobs = list(choice.logprobs) if params.logprobs is not None else None
        else:
            token_ids, logprobs = core.token_ids, core.logprobs
        completion = CompletionOutput(core.index, detok.output_text if ended or self.streaming else "", token_ids,
                                      finish_reason, logprobs)
        metrics = out.metrics
        if ended:
            choice.ended = True
            request.num_ended += 1
            request.num_completion_tokens += len(token_ids)
            if metrics is not None and metrics.finish_time is None:  # ended here, before the core knew
                metrics = replace(metrics, finish_time=time.monotonic())
        choices_running = params.n - request.num_ended
        finished = choices_running == 0
        if finished:
            del self._requests[out.request_id]
        # The step loop's output is the caller's from here on: completed in place (no copy per step).
        out.outputs, out.finished, out.new_token_ids, out.text_delta = [completion], finished, new_ids, delta
        out.new_logprobs, out.metrics, out.choices_running = new_logprobs, metrics, choices_running
        if finished:
            out.num_completion_tokens = request.num_completion_tokens
        return out
