"""Packed CPU matmuls run at bucketed row counts: the model pads a step's rows, and the padding
changes no result."""

import pytest

from services.engine import LLM, SamplingParams
from services.engine.linear import row_bucket
from tests.engine.conftest import assert_no_leak, mixed_prompts


def test_buckets_are_few_cover_every_count_and_waste_little():
    sizes = {row_bucket(rows) for rows in range(1, 2049)}
    assert len(sizes) <= 56
    assert all(row_bucket(rows) == rows for rows in range(1, 9))
    for rows in range(1, 9000):
        bucket = row_bucket(rows)
        assert bucket >= rows and row_bucket(bucket) == bucket
        if rows > 64:
            assert bucket - rows < rows / 8


class RowsSeen:
    """Calls through to a linear layer and records the rows of every call."""

    def __init__(self, linear):
        self.linear, self.rows = linear, []

    def __getattr__(self, name):
        return getattr(self.linear, name)

    def __call__(self, x):
        self.rows.append(x.shape[0])
        return self.linear(x)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    import json
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    return mixed_prompts(vocab)[:12]


def generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    return llm.generate(prompts, params)


def test_padded_rows_change_no_token_or_logprob(tiny_model_dir, prompts):
    padded = LLM(tiny_model_dir, max_num_seqs=12, max_num_batched_tokens=96)
    model = padded.engine.runner.model
    assert model.pads_rows  # fp32 on CPU: packed weights
    seen = model.layers[0].qkv = RowsSeen(model.layers[0].qkv)
    outputs = generate(padded, prompts)
    assert set(seen.rows) <= {row_bucket(r) for r in range(1, 97)}
    assert any(r not in range(1, 9) and r % 8 == 0 for r in seen.rows)

    exact = LLM(tiny_model_dir, max_num_seqs=12, max_num_batched_tokens=96)
    exact.engine.runner.model.pads_rows = False
    references = generate(exact, prompts)
    for out, ref in zip(outputs, references):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert got.keys() == want.keys()
            for token in got:
                assert got[token] == pytest.approx(want[token], abs=1e-4)
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
        for got, want in zip(out.prompt_logprobs, ref.prompt_logprobs):
            if want is not None:
                assert (got.token_id, got.rank) == (want.token_id, want.rank)
                assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert_no_leak(padded.engine)


def test_warm_up_runs_every_bucket_a_step_can_meet(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_num_seqs=12, max_num_batched_tokens=96)
    model = llm.engine.runner.model
    down = model.layers[0].down = RowsSeen(model.layers[0].down)
    head = model.lm_head = RowsSeen(model.lm_head)
    model.warm_up(96, 12)
    assert down.rows == sorted({row_bucket(r) for r in range(1, 97)}) and down.rows[-1] == 96
    assert head.rows == list(range(1, 9)) + [16]
