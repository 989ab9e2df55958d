"""Structured-output request fields -> one shared.protocol.StructuredSpec (pure, no I/O).

Three spellings, as clients send them: OpenAI's `response_format` (`text`, `json_object`,
`json_schema` with `strict`), vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
`json_object`) and vLLM's legacy `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. At most one constraint per request. Shapes are checked here; whether a schema,
regex or grammar compiles is the engine's answer (xgrammar's reason, as a 400).

`strict`: the engine always enforces the schema exactly (xgrammar's strict mode: no properties
beyond those listed unless the schema allows them), which is what `strict: true` asks for, and
output valid under `strict: false` too."""

from __future__ import annotations

import json
from typing import Any

from shared.protocol import StructuredSpec

# vLLM's structured_outputs keys Strata honours; any other key is refused by name.
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
GUIDED_BACKENDS = ("auto", "xgrammar")  # guided_decoding_backend values that mean what Strata runs


def _bad(message: str, param: str):
    from services.gateway.openai_api import bad

    return bad(message, param)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema (an object, or JSON text of one) as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _bad(f"'{param}' is not valid JSON: {exc}", param) from None
    if not isinstance(value, (dict, bool)):
        raise _bad(f"'{param}' must be a JSON schema (an object)", param)
    return json.dumps(value)


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec(json=_schema_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise _bad(f"'{param}' must be true when given", param)
        return StructuredSpec(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(f"'{param}' must be a non-empty list of non-empty strings", param)
        return StructuredSpec(choice=list(value))
    if not isinstance(value, str) or not value:
        raise _bad(f"'{param}' must be a non-empty string", param)
    return StructuredSpec(**{kind: value})


def _response_format(value: Any) -> StructuredSpec | None:
    if not isinstance(value, dict):
        raise _bad("'response_format' must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(json_object=True)
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("'response_format.json_schema' must be an object with a 'schema'", "response_format.json_schema")
        if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
            raise _bad("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict")
        if js.get("schema") is None:
            raise _bad("'response_format.json_schema.schema' is required", "response_format.json_schema.schema")
        return StructuredSpec(json=_schema_text(js["schema"], "response_format.json_schema.schema"))
    raise _bad(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
               "response_format.type")


def parse_structured(body: dict) -> StructuredSpec | None:
    """The request's structured-output constraint, or None; ApiError (400) naming the field."""
    found: list[tuple[str, StructuredSpec]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("'structured_outputs' must be an object", "structured_outputs")
        for key in so:
            if key not in STRUCTURED_OUTPUTS_KEYS and so[key] not in (None, False):
                raise _bad(f"'structured_outputs.{key}' is not supported (supported: "
                           f"{', '.join(STRUCTURED_OUTPUTS_KEYS)})", f"structured_outputs.{key}")
        for key in STRUCTURED_OUTPUTS_KEYS:
            if so.get(key) not in (None, False):
                found.append((f"structured_outputs.{key}", _spec(key, so[key], f"structured_outputs.{key}")))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, _spec(kind, body[name], name)))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise _bad(f"'guided_decoding_backend' {backend!r} is not available (Strata runs xgrammar)",
                   "guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise _bad("'guided_whitespace_pattern' is not supported", "guided_whitespace_pattern")
    if len(found) > 1:
        names = [name for name, _ in found]
        raise _bad(f"only one structured-output constraint per request, got {', '.join(names)}", names[1])
    return found[0][1] if found else None
