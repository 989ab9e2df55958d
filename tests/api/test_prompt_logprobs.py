"""Completions `echo` + `logprobs`, `text_offset`, vLLM's `prompt_logprobs`, with the official
`openai` client against a real stack: the prompt's logprobs equal transformers' fp32 log-softmax
of the same model's logits; lm-evaluation-harness scores a local multiple-choice task with them."""

import json
import os
import subprocess
import sys
import textwrap

import openai
import pytest
import torch

from tests.api.conftest import MODEL

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """ids -> log-softmax rows (row p: the distribution of token p + 1), transformers in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True, dtype=torch.float32)

    @torch.inference_mode()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def check_text_offsets(text: str, ids: list[int], offsets: list[int], tokenizer) -> None:
    """Each token's offset is where its text starts in the returned text."""
    assert len(offsets) == len(ids) and offsets[0] == 0
    for i, (token_id, offset) in enumerate(zip(ids, offsets)):
        piece = tokenizer.decode([token_id], skip_special_tokens=True)
        end = offsets[i + 1] if i + 1 < len(offsets) else len(text)
        if "\ufffd" not in piece:  # part of a character: its bytes have no text of their own
            assert text[offset:end] == piece, (i, token_id, offset)


def greedy(reference, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(reference(out)[-1].argmax()))
    return out[len(ids):]


def test_echo_logprobs_equal_the_reference(client, tokenizer, reference):
    prompt_ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first
    # The prompt, then the greedy completion (transformers' too), scored by the same model.
    ids = prompt_ids + greedy(reference, prompt_ids, 4)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert choice.text == PROMPT + tokenizer.decode(ids[n:], skip_special_tokens=True)
    ref = reference(ids)
    for p in range(1, n + 4):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4
        top = ref[p - 1].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(lp.top_logprobs[p][tokenizer.decode([t])] - v) < 1e-4
        assert abs(lp.top_logprobs[p][lp.tokens[p]] - lp.token_logprobs[p]) < 1e-4  # the token itself too
    check_text_offsets(choice.text, ids, lp.text_offset, tokenizer)
    assert lp.text_offset[n] == len(PROMPT)  # the completion starts where the prompt ends
    # Without echo: the same completion, its logprobs the same.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    assert choice.text == PROMPT + plain.choices[0].text
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_text_offset_without_echo(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.text_offset) == 8 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    # Offsets are the running length of the tokens' texts, which make up the returned text.
    pieces = [t if t not in tokenizer.all_special_tokens else "" for t in lp.tokens]
    assert lp.text_offset == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    if "\ufffd" not in "".join(pieces):
        assert "".join(pieces) == r.choices[0].text


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client, tokenizer, reference):
    prompt_ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=0, logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text == tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) and lp.token_logprobs[0] is None
    ref = reference(prompt_ids)
    assert max(abs(lp.token_logprobs[p] - ref[p - 1, prompt_ids[p]].item()) for p in range(1, len(prompt_ids))) < 1e-4
    check_text_offsets(choice.text, prompt_ids, lp.text_offset, tokenizer)
    # Without logprobs: the prompt back, nothing generated.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None and r.usage.completion_tokens == 0


def test_streamed_echo_equals_the_whole_response(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(whole.logprobs.token_logprobs)


def test_echo_in_a_batch_of_prompts_with_n_choices(client, tokenizer, reference):
    prompts = [PROMPT, "Hello there, general"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, temperature=0.8, seed=1,
                                  logprobs=0, echo=True, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:  # each choice echoes its own prompt, with that prompt's logprobs
        prompt = prompts[c.index // 2]
        ids = tokenizer.encode(prompt)
        ref = reference(ids)
        lp = c.logprobs
        assert c.text.startswith(prompt) and len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
        assert max(abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) for p in range(1, len(ids))) < 1e-4
        assert lp.text_offset[len(ids)] == len(prompt)


def test_vllm_prompt_logprobs(client, tokenizer, reference):
    prompt_ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    ref = reference(prompt_ids)
    for p in range(1, len(prompt_ids)):
        row, token = ref[p - 1], prompt_ids[p]
        own = entries[p][str(token)]
        assert abs(own["logprob"] - row[token].item()) < 1e-4
        assert own["rank"] == int((row > row[token]).sum()) + 1
        assert own["decoded_token"] == tokenizer.decode([token])
        top = row.topk(2).indices.tolist()
        assert all(entries[p][str(t)]["rank"] == i + 1 for i, t in enumerate(top))
    assert r.choices[0].logprobs is None  # not asked
    # Chat: vLLM's place for them is the response.
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"prompt_logprobs": 0})
    assert c.model_extra["prompt_logprobs"][0] is None and len(c.model_extra["prompt_logprobs"]) > 3
    streamed = [chunk.model_extra.get("prompt_logprobs") for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, stream=True,
        extra_body={"prompt_logprobs": 0})]
    assert [e for e in streamed if e is not None] == [c.model_extra["prompt_logprobs"]]  # once, on the first


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),  # 0 only to score the prompt
    (dict(echo="yes"), "echo"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
])
def test_bad_prompt_options_are_400s_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert err.value.param == param


def test_echo_with_chat_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"echo": True})
    assert err.value.param == "echo" and "echo" in err.value.message
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")  # the stack serves on


# ---- lm-evaluation-harness ---------------------------------------------------------------------
TASK = textwrap.dedent("""\
    task: strata_tiny_mc
    dataset_path: json
    dataset_kwargs:
      data_files:
        test: {data}
    test_split: test
    output_type: multiple_choice
    doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
    doc_to_choice: choices
    doc_to_target: answer
    metric_list:
      - metric: acc
        aggregation: mean
        higher_is_better: true
    """)

QUESTIONS = [
    ("What color is the sky on a clear day?", [" blue", " green", " purple", " orange"], 0),
    ("How many legs does a spider have?", [" six", " eight", " ten", " four"], 1),
    ("Which is a fruit?", [" carrot", " potato", " apple", " onion"], 2),
    ("What do bees make?", [" milk", " silk", " wool", " honey"], 3),
    ("Which animal barks?", [" dog", " cat", " fish", " bird"], 0),
    ("What is frozen water?", [" steam", " ice", " sand", " glass"], 1),
]


@pytest.mark.slow
def test_lm_eval_local_completions_scores_a_multiple_choice_task(api_stack, tiny_model_dir, tmp_path):
    """lm-eval's loglikelihood requests (echo, logprobs, max_tokens 1; batches of 4 prompts) for a
    local task: YAML and a JSONL file in the test's directory, nothing downloaded."""
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "strata_tiny_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "results"
    env = {**os.environ, "OPENAI_API_KEY": api_stack.api_key, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false"}
    model_args = ",".join([f"model={MODEL}", f"base_url={api_stack.base_url}/v1/completions",
                           f"tokenizer={tiny_model_dir}", "tokenizer_backend=huggingface", "tokenized_requests=True",
                           "num_concurrent=1", "max_retries=1", "max_length=2048"])
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "strata_tiny_mc", "--include_path", str(tasks), "--batch_size", "4",
           "--output_path", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1, list(out.rglob("*"))
    assert str(results[0]["config"]["batch_size"]) == "4"
    task = results[0]["results"]["strata_tiny_mc"]
    assert 0.0 <= task["acc,none"] <= 1.0  # random weights: any accuracy, but a number
    assert results[0]["n-samples"]["strata_tiny_mc"]["effective"] == len(QUESTIONS)
