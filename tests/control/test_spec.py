"""Deployment spec validation: each bad spec names the field and the reason."""

import json

import pytest

from services.control.spec import SpecError, parse_spec, validate


def good(model_dir, **overrides):
    spec = {"name": "tiny", "model": str(model_dir), "aliases": ["tiny-chat"], "engine": {"max_num_seqs": 8},
            "replicas": {"min": 1, "max": 3}, "slo": {"ttft_ms": 500, "itl_ms": 50},
            "routing": {"policy": "least_load"}, "canary": {"weight": 20},
            "scaling": {"target_concurrency": 4}}
    spec.update(overrides)
    return spec


def errors_of(data) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        validate(data)
    return dict(info.value.errors)


def test_a_good_spec_round_trips(tiny_model_dir):
    spec = validate(good(tiny_model_dir))
    assert (spec.name, spec.replicas.max, spec.slo.ttft_ms, spec.routing_policy, spec.canary_weight) == \
        ("tiny", 3, 500, "least_load", 20)
    assert spec.engine == {"max_num_seqs": 8}
    # JSON and YAML both parse
    assert parse_spec(json.dumps(good(tiny_model_dir)))["name"] == "tiny"
    assert parse_spec(f"name: tiny\nmodel: {tiny_model_dir}\n")["model"] == str(tiny_model_dir)


@pytest.mark.parametrize("overrides, field, reason", [
    ({"colour": "blue"}, "colour", "unknown field"),
    ({"name": "has space"}, "name", "letters, digits"),
    ({"name": None}, "name", "required"),
    ({"replicas": {"min": 4, "max": 2}}, "replicas", "min (4) is greater than max (2)"),
    ({"replicas": {"min": "1", "max": 2}}, "replicas.min", "must be an integer, got str"),
    ({"replicas": {"min": 1, "max": 2, "maximum": 3}}, "replicas.maximum", "unknown field"),
    ({"slo": {"ttft_ms": -5}}, "slo.ttft_ms", "must not be negative"),
    ({"engine": {"max_num_seqs": "lots"}}, "engine.max_num_seqs", "must be an integer"),
    ({"engine": {"turbo": True}}, "engine.turbo", "unknown engine argument"),
    ({"routing": {"policy": "random"}}, "routing.policy", "must be one of round_robin, least_load, kv_aware"),
    ({"canary": {"weight": 150}}, "canary.weight", "percentage from 0 to 100"),
    ({"aliases": "tiny2"}, "aliases", "must be a list"),
    ({"scaling": {"stable_window_s": 4}}, "scaling.panic_window_s", "must not exceed stable_window_s (4)"),
    ({"model": "/nonexistent/model"}, "model", "does not exist"),
    ({"model": 42}, "model", "must be a string"),
])
def test_bad_specs_name_the_field_and_reason(tiny_model_dir, overrides, field, reason):
    errors = errors_of(good(tiny_model_dir, **overrides))
    assert field in errors, errors
    assert reason in errors[field], errors


def test_every_problem_is_reported_at_once(tiny_model_dir):
    errors = errors_of({"name": "x y", "model": str(tiny_model_dir), "replicas": {"min": 3, "max": 1},
                        "extra": 1})
    assert set(errors) == {"name", "replicas", "extra"}


def test_model_of_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    errors = errors_of({"name": "gpt2", "model": str(tmp_path)})
    assert "architecture" in errors["model"] and "not supported" in errors["model"]


def test_not_a_mapping():
    with pytest.raises(SpecError) as info:
        parse_spec("- just\n- a list\n")
    assert info.value.errors[0][0] == "(file)"
    with pytest.raises(SpecError):
        parse_spec("name: [unclosed")
