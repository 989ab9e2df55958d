"""The deployment spec checks engine.quantization and engine.kv_cache_dtype against what
engine.device runs (services.engine.quantization.support), naming the field."""

import pytest

from services.control.spec import SpecError, validate
from services.engine.config import EngineArgs


def spec(model_dir, **engine):
    return {"name": "tiny", "model": str(model_dir), "engine": engine}


def test_quantization_fields_that_the_device_runs_are_accepted(tiny_model_dir):
    for engine in ({"quantization": "int8"}, {"quantization": "int4", "kv_cache_dtype": "int8"},
                   {"quantization": "fp8", "device": "cuda", "kv_cache_dtype": "fp8"}):
        assert validate(spec(tiny_model_dir, **engine)).engine == engine
    # The scaler's command line for such a spec parses back to the same engine arguments.
    flags = EngineArgs.cli_flags({"quantization": "int4", "kv_cache_dtype": "int8"})
    assert flags == ["--quantization", "int4", "--kv-cache-dtype", "int8"]


@pytest.mark.parametrize("engine, field, reason", [
    ({"quantization": "fp8"}, "engine.quantization", "fp8 is not supported on cpu; it runs on cuda only"),
    ({"quantization": "fp8", "device": "cpu"}, "engine.quantization", "cpu runs int8, int4"),
    ({"kv_cache_dtype": "fp8"}, "engine.kv_cache_dtype", "fp8 is not supported on cpu"),
    ({"kv_cache_dtype": "int8", "device": "cuda:1"}, "engine.kv_cache_dtype", "int8 is not supported on cuda"),
    ({"quantization": "awq"}, "engine.quantization", "unknown quantization 'awq'"),
    ({"kv_cache_dtype": "int4"}, "engine.kv_cache_dtype", "unknown KV-cache dtype 'int4'"),
    ({"quantization": 8}, "engine.quantization", "must be a string"),
])
def test_quantization_the_device_cannot_run_is_refused(tiny_model_dir, engine, field, reason):
    with pytest.raises(SpecError) as info:
        validate(spec(tiny_model_dir, **engine))
    errors = dict(info.value.errors)
    assert reason in errors[field], errors
