"""Adapters declared in a deployment spec: checked by control, served by the replicas the
scaler starts, and changed live (same revision, same replica, no restart)."""

from __future__ import annotations

import json
import time

import pytest
from openai import OpenAI

from services.control.client import ControlError
from services.control.spec import SpecError, validate

pytestmark = pytest.mark.slow


def spec(model_dir, adapters, **engine):
    return {"name": "lora-demo", "model": str(model_dir), "replicas": {"min": 1, "max": 1},
            "engine": {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, **engine}, "adapters": adapters}


def served_models(client: OpenAI) -> dict[str, str | None]:
    return {m.id: (m.model_extra or {}).get("parent") for m in client.models.list().data}


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def test_spec_adapters_are_checked(tiny_model_dir, peft_adapters):
    good = {"name": "a", "path": str(peft_adapters["attn-r8"])}
    assert validate(spec(tiny_model_dir, [good])).adapters == [good]
    with pytest.raises(SpecError) as info:
        validate({**spec(tiny_model_dir, [good, good, {"name": "x:y", "path": str(peft_adapters["mlp-r4"])},
                                          {"name": "big", "path": str(peft_adapters["all-r16"])}, {"name": "z"}])})
    reasons = dict(info.value.errors)
    assert "declared twice" in reasons["adapters[1].name"]
    assert "no ':'" in reasons["adapters[2].name"]
    assert "above this engine's max_lora_rank 8" in reasons["adapters[3].path"]
    assert "exactly name and path" in reasons["adapters[4]"]
    with pytest.raises(SpecError, match="enable_lora"):
        validate({**spec(tiny_model_dir, [good]), "engine": {}})


def test_adapters_in_the_spec_apply_live(managed_stack, tiny_model_dir, peft_adapters):
    stack, control = managed_stack, managed_stack.client
    client = OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    first = control.deploy(json.dumps(spec(tiny_model_dir, [
        {"name": "attn", "path": str(peft_adapters["attn-r8"])}])))
    try:
        assert first["revision"] == 1 and not first["live"]
        stack.wait_replicas("lora-demo", 1, timeout=120)
        wait_for(lambda: served_models(client).get("attn") == "lora-demo")
        replica = client.completions.create(model="lora-demo:attn", prompt="Hello", max_tokens=3,
                                            temperature=0).model_extra["strata"]["replica_id"]
        # The same spec with other adapters: no new revision, the running replica switches.
        second = control.deploy(json.dumps(spec(tiny_model_dir, [
            {"name": "mlp", "path": str(peft_adapters["mlp-r4"])}])))
        assert second["live"] and second["revision"] == 1
        assert second["adapters"] == {"loaded": ["mlp"], "unloaded": ["attn"]}
        wait_for(lambda: "attn" not in served_models(client) and served_models(client).get("mlp") == "lora-demo")
        out = wait_for(lambda: _try(client, "mlp"))
        assert out.model_extra["strata"]["replica_id"] == replica  # no restart
        with pytest.raises(Exception) as info:
            client.completions.create(model="lora-demo:attn", prompt="Hello", max_tokens=3)
        assert getattr(info.value, "status_code", None) == 404
        assert [e["action"] for e in control.history("lora-demo")["events"]] == ["apply", "adapters"]
    finally:
        try:
            control.delete("lora-demo")
        except ControlError:
            pass


def _try(client, model):
    try:
        return client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    except Exception:
        return None
