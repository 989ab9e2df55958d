"""The deployment spec: what an operator writes, checked before anything is stored.

A spec is YAML or JSON. Every error names the field and the reason, and all errors are reported
at once, so a bad file is fixed in one go:

    name: tiny                  # served model name (letters, digits, - and _)
    model: /models/tiny-llama   # a Hugging Face directory of a supported architecture
    aliases: [tiny-chat]        # more names clients may use
    engine: {max_num_seqs: 32}  # engine arguments (vLLM names)
    replicas: {min: 1, max: 4}
    slo: {ttft_ms: 2000, itl_ms: 200}
    routing: {policy: kv_aware}
    canary: {weight: 20}        # > 0: this revision starts as a canary with that share of traffic
    # or, judged and walked through its steps by control (services.control.canary):
    # canary: {analysis: {steps: [5, 25, 50, 100], interval_s: 10, min_requests: 50, alpha: 0.05,
    #                     thresholds: {ttft_p90_ratio: 1.5, itl_p50_ratio: 1.5, error_rate_diff: 0.02}}}
    scaling: {target_concurrency: 16, scale_down_delay_s: 30, scale_to_zero_after_s: 120}
    placement: {pools: [spot-east, gcp-west], prefer: cheapest, min_pools: 2}   # capacity pools
    limits: {default_max_tokens: 1024}  # chat requests that give no max_tokens
    tool_call_parser: hermes    # tool_choice "auto" reads calls so (services.gateway.tool_parsers)
    adapters: [{name: sql, path: /adapters/sql}]  # LoRA adapters (needs engine.enable_lora), applied live

Pure: no I/O except reading the model's config.json to check its architecture (and each
adapter's config and safetensors header against it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from services.control.canary import parse_analysis
from services.engine.config import EngineArgs
from services.engine.model_config import ModelConfig
from shared.deployments import NAME_RE, DeploymentSpec, Limits, Replicas, Scaling, Slo, parse_placement
from services.gateway.tool_parsers import TOOL_PARSERS
from services.scheduler.policy import POLICIES


# Engine arguments a deployment may set, with their types; each maps to one engine flag
# (services.engine.config.EngineArgs defines both).
ENGINE_ARGS: dict[str, type] = EngineArgs.spec_args()


class SpecError(ValueError):
    """An invalid spec; `errors` lists (field, reason) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{f}: {r}" for f, r in errors))


def _type_name(t) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping"}.get(t, t.__name__)


def _check_type(value: Any, t: type) -> bool:
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def _section(raw: Any, cls, where: str, errors: list) -> Any:
    """A nested dataclass section: known fields of the right types, others reported."""
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        errors.append((where, "must be a mapping"))
        return cls()
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in types:
            errors.append((f"{where}.{key}", f"unknown field (known: {', '.join(types)})"))
            continue
        t = {"int": int, "float": float}[types[key]]
        if not _check_type(value, t):
            errors.append((f"{where}.{key}", f"must be {_type_name(t)}, got {type(value).__name__}"))
        elif value < 0:
            errors.append((f"{where}.{key}", "must not be negative"))
        else:
            values[key] = value
    return cls(**values)


def _canary(raw: Any, errors: list) -> dict:
    """`canary: {weight, analysis}`; with an analysis the weight is its first step (and may be
    left out), and the analysis is stored with every default filled in (services.control.canary)."""
    if not isinstance(raw, dict) or set(raw) - {"weight", "analysis"}:
        errors.append(("canary", "must be a mapping with the fields weight and analysis"))
        return {"weight": 0}
    out = {"weight": raw.get("weight", 0)}
    if not _check_type(out["weight"], int) or not 0 <= out["weight"] <= 100:
        errors.append(("canary.weight", "must be an integer percentage from 0 to 100"))
        return {"weight": 0}
    if "analysis" in raw:
        config, problems = parse_analysis(raw["analysis"])
        errors.extend(problems)
        if config is None:
            return out
        first = config.steps[0]
        if "weight" in raw and out["weight"] != first:
            errors.append(("canary.weight", f"must be the analysis' first step ({first}) or left out"))
        out = {"weight": first, "analysis": config.to_dict()}
    return out


def parse_spec(text: str) -> dict:
    """YAML or JSON text to a mapping."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError([("(file)", f"not valid YAML or JSON: {exc}")]) from None
    if not isinstance(data, dict):
        raise SpecError([("(file)", "must be a mapping of fields")])
    return data


def validate(data: Any, check_model: bool = True) -> DeploymentSpec:
    """The spec, or SpecError listing every problem (field, reason)."""
    if not isinstance(data, dict):
        raise SpecError([("(spec)", "must be a mapping of fields")])
    errors: list[tuple[str, str]] = []
    known = {f.name for f in dataclasses.fields(DeploymentSpec)}
    for key in data:
        if key not in known:
            errors.append((str(key), f"unknown field (known: {', '.join(sorted(known))})"))

    name = data.get("name")
    if name is None:
        errors.append(("name", "required"))
    elif not isinstance(name, str) or not NAME_RE.match(name):
        errors.append(("name", "must be 1-63 letters, digits, '-' or '_', starting with a letter or digit"))

    model = data.get("model")
    if model is None:
        errors.append(("model", "required"))
    elif not isinstance(model, str):
        errors.append(("model", f"must be a string (a model directory), got {type(model).__name__}"))
    elif check_model:
        if not Path(model).is_dir():
            errors.append(("model", f"directory {model} does not exist"))
        else:
            try:
                ModelConfig.load(model)
            except (ValueError, KeyError, OSError) as exc:
                errors.append(("model", f"not a supported model: {exc}"))

    aliases = data.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and NAME_RE.match(a) for a in aliases):
        errors.append(("aliases", "must be a list of names (letters, digits, '-' or '_')"))
        aliases = []
    elif name in aliases:
        errors.append(("aliases", "must not repeat the deployment's name"))

    engine = data.get("engine", {})
    if not isinstance(engine, dict):
        errors.append(("engine", "must be a mapping of engine arguments"))
        engine = {}
    typed = {}
    for key, value in engine.items():
        if key not in ENGINE_ARGS:
            errors.append((f"engine.{key}", f"unknown engine argument (known: {', '.join(ENGINE_ARGS)})"))
        elif not _check_type(value, ENGINE_ARGS[key]):
            errors.append((f"engine.{key}", f"must be {_type_name(ENGINE_ARGS[key])}, got {type(value).__name__}"))
        else:
            typed[key] = value
    # The engine's own checks (each argument's and across arguments) on the values of the right types.
    errors += [(f"engine.{key}", reason) for key, reason in EngineArgs.spec_problems(typed)]

    replicas = _section(data.get("replicas"), Replicas, "replicas", errors)
    if replicas.min > replicas.max:
        errors.append(("replicas", f"min ({replicas.min}) is greater than max ({replicas.max})"))
    if replicas.max < 1:
        errors.append(("replicas.max", "must be at least 1"))
    slo = _section(data.get("slo"), Slo, "slo", errors)
    if slo.ttft_ms <= 0 or slo.itl_ms <= 0:
        errors.append(("slo", "ttft_ms and itl_ms must be positive"))
    scaling = _section(data.get("scaling"), Scaling, "scaling", errors)
    if scaling.target_concurrency <= 0:
        errors.append(("scaling.target_concurrency", "must be positive"))
    elif scaling.panic_window_s > scaling.stable_window_s:
        errors.append(("scaling.panic_window_s", f"({scaling.panic_window_s:g}) must not exceed "
                                                 f"stable_window_s ({scaling.stable_window_s:g})"))

    limits = _section(data.get("limits"), Limits, "limits", errors)
    if limits.default_max_tokens < 1:
        errors.append(("limits.default_max_tokens", "must be at least 1"))

    tool_call_parser = data.get("tool_call_parser", "")
    if tool_call_parser and (not isinstance(tool_call_parser, str) or tool_call_parser not in TOOL_PARSERS):
        errors.append(("tool_call_parser", f"unknown tool call parser {str(tool_call_parser)[:64]!r} "
                                           f"(known: {', '.join(TOOL_PARSERS)})"))
        tool_call_parser = ""

    routing = data.get("routing", {"policy": "kv_aware"})
    if not isinstance(routing, dict) or set(routing) - {"policy"}:
        errors.append(("routing", "must be a mapping with one field, policy"))
        routing = {"policy": "kv_aware"}
    elif routing.get("policy", "kv_aware") not in POLICIES:
        errors.append(("routing.policy", f"must be one of {', '.join(POLICIES)}, got {routing.get('policy')!r}"))

    canary = _canary(data.get("canary", {"weight": 0}), errors)

    placement = parse_placement(data.get("placement"), errors)
    adapter_list = _adapters(data.get("adapters", []), model if check_model and isinstance(model, str) else None,
                             engine, errors)

    if errors:
        raise SpecError(errors)
    return DeploymentSpec(name=name, model=model, aliases=list(aliases), engine=dict(engine), replicas=replicas,
                          slo=slo, routing=dict(routing), canary=dict(canary), scaling=scaling, placement=placement,
                          limits=limits, tool_call_parser=tool_call_parser, adapters=adapter_list)


def _adapters(raw: Any, model: str | None, engine: dict, errors: list) -> list[dict[str, str]]:
    """`adapters`: [{name, path}], each checked against the model (when `model` is given) and
    the engine's max_lora_rank; they need engine.enable_lora."""
    from services.engine.lora import LoRAAdapterError, inspect_adapter
    from shared.adapters import check_name

    if not isinstance(raw, list):
        errors.append(("adapters", "must be a list of {name, path}"))
        return []
    if raw and engine.get("enable_lora") is not True:
        errors.append(("adapters", "LoRA adapters need engine.enable_lora: true"))
    config = None
    if model is not None and Path(model).is_dir():
        try:
            config = ModelConfig.load(model)
        except (ValueError, KeyError, OSError):
            pass  # reported for `model` already
    rank = engine.get("max_lora_rank", EngineArgs.max_lora_rank)
    out, seen = [], set()
    for i, entry in enumerate(raw):
        where = f"adapters[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"name", "path"}:
            errors.append((where, "must be a mapping with exactly name and path"))
            continue
        name, path = entry["name"], entry["path"]
        why = check_name(name)
        if why is not None:
            errors.append((f"{where}.name", why))
        elif name in seen:
            errors.append((f"{where}.name", f"{name!r} is declared twice"))
        seen.add(name)
        if not isinstance(path, str) or not path:
            errors.append((f"{where}.path", "must be the adapter's directory"))
            continue
        if config is not None and isinstance(rank, int):
            try:
                inspect_adapter(path, config, rank)
            except LoRAAdapterError as exc:
                errors.append((f"{where}.path", str(exc)))
        out.append({"name": name, "path": path})
    return out
