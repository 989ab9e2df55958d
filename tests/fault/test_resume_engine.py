"""The engine side of mid-stream migration: a request resumed from the tokens another replica
already delivered (protocol.Resume) continues exactly as the uninterrupted run would have."""

import pytest

from services.engine.config import EngineArgs
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a land far away, there lived"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, EngineArgs.from_kwargs(num_kv_blocks=256, num_threads=1))


def run(engine, rid, ids, params, resumed=(0, 0)):
    """Stream one request to its end; (token ids, text, finish reason, completion tokens)."""
    engine.add_processed(rid, None, ids, params, resumed=resumed)
    tokens, text = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.text_delta
            if out.finished:
                return tokens, text, out.outputs[0].finish_reason, len(out.outputs[0].token_ids)
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("cut", [0, 1, 17, 20, 39])  # greedy: token 20 ends inside a character
@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    dict(temperature=0.9, seed=1234, top_p=0.95),
    dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
])
def test_a_resumed_request_continues_the_uninterrupted_stream(engine, cut, sampling):
    prompt = engine.tokenizer.encode(PROMPT)
    full_tokens, full_text, reason, _ = run(engine, "whole", prompt, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                                  **sampling))
    # What the lost replica had delivered: `cut` tokens (one per step) and the text streamed with them.
    engine.add_processed("first-leg", None, prompt, SamplingParams(max_tokens=40, ignore_eos=True, **sampling))
    sent_tokens, sent_text = [], ""
    while len(sent_tokens) < cut:
        for out in engine.step():
            sent_tokens += out.new_token_ids
            sent_text += out.text_delta
    engine.abort_request("first-leg")
    engine.step()
    rest_tokens, rest_text, rest_reason, completion = run(
        engine, "second-leg", prompt + sent_tokens, SamplingParams(max_tokens=40, ignore_eos=True, **sampling),
        resumed=(cut, len(sent_text)))
    assert sent_tokens + rest_tokens == full_tokens
    assert sent_text + rest_text == full_text
    assert (rest_reason, completion) == (reason, 40)


def test_text_held_back_for_a_stop_string_is_delivered_after_the_resume(engine):
    prompt = engine.tokenizer.encode(PROMPT)
    greedy = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    _, text, _, _ = run(engine, "probe", prompt, greedy)
    stop = text[-12:]  # a stop string near the end: text before it is held back while it may start
    full_tokens, full_text, reason, _ = run(engine, "with-stop", prompt, SamplingParams(
        max_tokens=30, ignore_eos=True, temperature=0.0, stop=[stop]))
    assert reason == "stop"
    cut = len(full_tokens) - 3
    prefix = engine.tokenizer.decode(full_tokens[:cut])
    delivered = prefix[:max(len(prefix) - (len(stop) - 1), 0)]  # what the holdback let through
    rest_tokens, rest_text, rest_reason, _ = run(
        engine, "resumed-stop", prompt + full_tokens[:cut], SamplingParams(
            max_tokens=30, ignore_eos=True, temperature=0.0, stop=[stop]), resumed=(cut, len(delivered)))
    assert full_tokens[:cut] + rest_tokens == full_tokens
    assert delivered + rest_text == full_text
    assert rest_reason == "stop"
