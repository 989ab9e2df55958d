"""Incremental detokenization: multi-byte UTF-8 and stop strings across token boundaries."""

from transformers import AutoTokenizer

from services.engine.detokenizer import IncrementalDetokenizer


def stream(tokenizer, prompt_ids, output_ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, prompt_ids, list(stop))
    ids = list(prompt_ids)
    deltas, stopped = [], False
    for t in output_ids:
        ids.append(t)
        stopped = detok.append(ids)
        deltas.append(detok.take_delta(stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(detok.take_delta(True))
    return deltas, detok.output_text, stopped


def test_multibyte_characters_are_never_split(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = " Größe 日本語のテキスト 🚀✨ Ελληνικά"
    prompt = tokenizer.encode("Say:")
    output = tokenizer.encode(text, add_special_tokens=False)
    # Byte-level BPE splits some of these characters across tokens: the test means something.
    assert any("\ufffd" in tokenizer.decode([t]) for t in output)
    deltas, final, _ = stream(tokenizer, prompt, output)
    assert "".join(deltas) == final == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_across_tokens_is_cut_and_never_leaked(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "alpha beta gamma delta epsilon"
    output = tokenizer.encode(text, add_special_tokens=False)
    deltas, final, stopped = stream(tokenizer, [], output, stop=["ma del"])
    assert stopped and final == "alpha beta gam"
    assert "".join(deltas) == "alpha beta gam"
    deltas, final, stopped = stream(tokenizer, [], output, stop=["zzz"])
    assert not stopped and "".join(deltas) == text
