"""The OpenAPI 3.1 description of the gateway's HTTP API, served at /openapi.json."""

from __future__ import annotations

from shared.sampling_ranges import LOGIT_BIAS, MAX_STOP_STRINGS, RANGES

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}

INT32_MAX = 2**31 - 1
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}

# The numbers' ranges are shared.sampling_ranges' (what the gateway, the wire and the engine check).
_SAMPLING = {
    "max_tokens": {**RANGES["max_tokens"].json_schema(),
                   "description": "default: the deployment's default_max_tokens (and never past the context)"},
    "temperature": RANGES["temperature"].json_schema(),
    "top_p": RANGES["top_p"].json_schema(),
    "top_k": {**RANGES["top_k"].json_schema(), "description": "-1 or 0 = off (extension, vLLM's)"},
    "min_p": RANGES["min_p"].json_schema(),
    "seed": RANGES["seed"].json_schema(),
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS}]},
    "stop_token_ids": {"type": "array", "items": TOKEN_ID},
    "ignore_eos": {"type": "boolean"},
    "presence_penalty": RANGES["presence_penalty"].json_schema(),
    "frequency_penalty": RANGES["frequency_penalty"].json_schema(),
    "repetition_penalty": RANGES["repetition_penalty"].json_schema(),
    # Structured outputs (services.gateway.structured_outputs): at most one constraint per request.
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}]},
    "structured_outputs": {"type": "object", "additionalProperties": False, "minProperties": 1, "maxProperties": 1,
                           "description": "vLLM's: exactly one of json, regex, choice, grammar, json_object",
                           "properties": {"json": {"type": "object"}, "regex": {"type": "string", "minLength": 1},
                                          "choice": {"type": "array", "minItems": 1,
                                                     "items": {"type": "string", "minLength": 1}},
                                          "grammar": {"type": "string", "minLength": 1},
                                          "json_object": {"const": True}}},
    "guided_json": {"type": "object", "description": "vLLM's legacy structured_outputs.json"},
    "guided_regex": {"type": "string", "minLength": 1},
    "guided_choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    "guided_grammar": {"type": "string", "minLength": 1},
    "guided_decoding_backend": {"enum": ["auto", "xgrammar"]},
    "n": {"type": "integer", "minimum": 1, "maximum": 16,
          "description": "choices per prompt (at most the gateway's --max-n, default 16)"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "additionalProperties": False,
                       "properties": {"include_usage": {"type": "boolean"},
                                      "continuous_usage_stats": {
                                          "type": "boolean", "description": "the usage so far on every chunk"}},
                       "description": "only with stream: true"},
    "user": {"type": "string", "maxLength": 256, "description": "the end user: on the request's log lines and "
                                                               "span (user.id)"},
    "guided_whitespace_pattern": {"type": "null", "description": "vLLM's: not supported (only null)"},
    # Logits processors and text options, vLLM's names (services/gateway/request_fields.py).
    "logit_bias": {"type": "object", "maxProperties": 1024,
                   "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"},
                   "additionalProperties": LOGIT_BIAS.json_schema(),
                   "description": "token id (a string of digits, inside the vocabulary) -> bias added to its logit"},
    "allowed_token_ids": {"type": "array", "items": TOKEN_ID, "minItems": 1,
                          "description": "only these tokens may be generated (inside the vocabulary)"},
    "bad_words": {"type": "array", "maxItems": 256, "items": {"type": "string", "pattern": "\\S"},
                  "description": "words never generated (with and without a leading space)"},
    "min_tokens": {**RANGES["min_tokens"].json_schema(),
                   "description": "EOS and stop_token_ids masked, stop strings unchecked, until this many "
                                  "tokens (at most max_tokens)"},
    "skip_special_tokens": {"type": "boolean"},
    "include_stop_str_in_output": {"type": "boolean"},
}
_MODEL = {"type": "string", "minLength": 1}

# Tool calling (services.gateway.tools). The schema says less than the gateway accepts where a
# static schema cannot say it: any JSON schema as parameters (here: objects of typed
# properties), and a named tool_choice ({"type": "function", "function": {"name"}}), which must
# name one of the tools.
_JSON_TYPE = {"enum": ["string", "integer", "number", "boolean", "array", "object", "null"]}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema of the arguments", "properties": {
            "type": {"const": "object"},
            "properties": {"type": "object", "additionalProperties": {
                "type": "object", "properties": {"type": _JSON_TYPE, "description": {"type": "string"}}}},
            "required": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
        "strict": {"type": "boolean"}}}}}
_TOOLS = {
    "tools": {"type": "array", "items": _TOOL, "minItems": 1, "maxItems": 128},
    "tool_choice": {"enum": ["none", "auto", "required"],
                    "description": "or {'type': 'function', 'function': {'name': ...}} naming one of the tools; "
                                   "'auto' (the default with tools) needs the model's tool_call_parser"},
    "parallel_tool_calls": {"type": "boolean"},
}


def _only_with(field: str, condition: dict) -> dict:
    """`field` may be present only when `condition` (properties, with their required names) holds."""
    return {"anyOf": [{"not": {"required": [field]}}, condition]}


# At most one structured-output constraint per request (response_format "text" is none).
_CONSTRAINTS = [{"required": [name]} for name in ("structured_outputs", "guided_json", "guided_regex",
                                                  "guided_choice", "guided_grammar")] + [
    {"required": ["response_format"],
     "properties": {"response_format": {"properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}]
_ONE_CONSTRAINT = {"not": {"anyOf": [{"allOf": [a, b]} for i, a in enumerate(_CONSTRAINTS)
                                     for b in _CONSTRAINTS[i + 1:]]}}

_STREAM_OPTIONS_NEED_STREAM = _only_with("stream_options", {"properties": {"stream": {"const": True}},
                                                            "required": ["stream"]})
_TOOL_CHOICE_NEEDS_TOOLS = _only_with("tool_choice", {"required": ["tools"]})
# best_of must be >= n and is not streamed (the best choices are known only at the end): what a
# static schema can say of that is best_of without n and without stream: true.
_BEST_OF = {"type": "integer", "minimum": 1, "maximum": 16,
            "description": "choices generated per prompt, of which the n with the highest cumulative logprob "
                           "are returned; >= n; not with stream"}
_BEST_OF_ALONE = _only_with("best_of", {"not": {"anyOf": [{"required": ["n"]}, {
    "properties": {"stream": {"const": True}}, "required": ["stream"]}]}})

# Prompt logprobs (services.gateway.prompt_logprobs): max_tokens 0 scores the prompt only.
_PROMPT_LOGPROBS = {**RANGES["prompt_logprobs"].json_schema(),
                    "description": "vLLM's: top-n logprobs per prompt token, as `prompt_logprobs` in each choice"}
_MAX_TOKENS_ZERO_SCORES_THE_PROMPT = {
    "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
    "then": {"anyOf": [{"properties": {"echo": {"const": True}}, "required": ["echo"]},
                       {"required": ["prompt_logprobs"]}]}}

_USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}


def _errors(*statuses: int) -> dict:
    descriptions = {400: "Invalid request", 401: "Missing or invalid API key", 403: "Needs an admin key",
                    404: "Unknown model (or adapter)", 408: "The request body did not arrive in time",
                    409: "Another adapter has that name", 413: "Request body too large",
                    429: "Rate limited (see retry-after)",
                    503: "Overloaded: no capacity before the deadline (see retry-after)", 504: "Timed out"}
    return {str(s): {"description": descriptions[s],
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


_DEADLINE_HEADERS = [
    {"name": "Strata-Timeout", "in": "header", "required": False,
     "description": "seconds the request may take (default: the gateway's --request-timeout)",
     "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}},
    {"name": "Strata-Deadline", "in": "header", "required": False,
     "description": "unix seconds by which the request must be answered (504 if already past)",
     "schema": {"type": "number"}},
]


def openapi_spec(server_url: str = "") -> dict:
    generation_errors = _errors(400, 401, 404, 408, 413, 429, 503, 504)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Strata gateway", "version": "1", "description": "OpenAI-compatible inference API."},
        "servers": [{"url": server_url}] if server_url else [],
        "security": [{"bearer": []}],
        "paths": {
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "Served models", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array"}}}}}},
                **_errors(401)}}},
            "/v1/completions": {"post": {
                "operationId": "createCompletion",
                "parameters": _DEADLINE_HEADERS,
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "$ref": "#/components/schemas/CompletionRequest"}}}},
                "responses": {"200": {"description": "A completion, or an SSE stream when stream is true",
                                      "content": {"application/json": {"schema": {"type": "object"}},
                                                  "text/event-stream": {"schema": {"type": "string"}}}},
                              **generation_errors}}},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion",
                "parameters": _DEADLINE_HEADERS,
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "$ref": "#/components/schemas/ChatCompletionRequest"}}}},
                "responses": {"200": {"description": "A chat completion, or an SSE stream when stream is true",
                                      "content": {"application/json": {"schema": {"type": "object"}},
                                                  "text/event-stream": {"schema": {"type": "string"}}}},
                              **generation_errors}}},
            **{f"/v1/{verb}_lora_adapter": {"post": {
                "operationId": f"{verb}LoraAdapter",
                "description": f"{verb.capitalize()} a LoRA adapter for a base model (admin key), as vLLM's API.",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "$ref": "#/components/schemas/LoraAdapterRequest"}}}},
                "responses": {"200": {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **_errors(400, 401, 403, 404, 409)}}} for verb in ("load", "unload")},
            "/v1/models/{name}": {"get": {
                "operationId": "retrieveModel",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model's entry, as in /v1/models",
                                      "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Model"}}}},
                              **_errors(401, 404)}}},
            "/tokenize": {"post": {
                "operationId": "tokenize", "description": "vLLM's /tokenize: a prompt, or chat messages as rendered "
                                                          "by the model's chat template.",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "$ref": "#/components/schemas/TokenizeRequest"}}}},
                "responses": {"200": {"description": "The token ids", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
                        "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                        "tokens": {"type": "array", "items": {"type": "integer"}},
                        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}}}}},
                              **_errors(400, 401, 404, 408, 413)}}},
            "/detokenize": {"post": {
                "operationId": "detokenize", "description": "vLLM's /detokenize.",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["tokens"], "properties": {
                        "model": _MODEL, "tokens": {"type": "array", "items": TOKEN_ID}}}}}},
                "responses": {"200": {"description": "The text", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}}},
                              **_errors(400, 401, 404, 408, 413)}}},
            "/version": {"get": {"operationId": "version", "responses": {
                "200": {"description": "The server's version", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}},
                **_errors(401)}}},
            "/health": {"get": {"operationId": "health", "security": [],
                                "responses": {"200": {"description": "Healthy"}, "503": {"description": "Degraded"}}}},
            "/metrics": {"get": {"operationId": "metrics", "security": [],
                                 "responses": {"200": {"description": "Prometheus metrics"}}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _ERROR,
                "LoraAdapterRequest": {"type": "object", "required": ["lora_name"], "additionalProperties": False,
                                       "properties": {
                    "lora_name": {"type": "string"}, "lora_path": {"type": "string", "description": "load only (refused by unload)"},
                    "model": {"type": "string", "description": "the base model (when the gateway serves several)"}}},
                "Usage": _USAGE,
                "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
                    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                    "owned_by": {"type": "string"}, "root": {"type": ["string", "null"]},
                    "parent": {"type": ["string", "null"]}, "max_model_len": {"type": ["integer", "null"]},
                    "permission": {"type": "array", "items": {"type": "object"}}}},
                "TokenizeRequest": {"oneOf": [
                    {"type": "object", "required": ["prompt"], "not": {"required": ["messages"]}, "properties": {
                        "model": _MODEL, "prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"},
                        "return_token_strs": {"type": "boolean"}}},
                    {"type": "object", "required": ["messages"], "not": {"required": ["prompt"]}, "properties": {
                        "model": _MODEL, "messages": {
                            "$ref": "#/components/schemas/ChatCompletionRequest/properties/messages"},
                        "add_generation_prompt": {"type": "boolean"}, "continue_final_message": {"type": "boolean"},
                        "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}}]},
                # Every field the gateway takes is listed: any other is refused with a 400.
                "CompletionRequest": {
                    "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
                    "allOf": [_STREAM_OPTIONS_NEED_STREAM, _ONE_CONSTRAINT, _BEST_OF_ALONE,
                              _MAX_TOKENS_ZERO_SCORES_THE_PROMPT],
                    "properties": {
                        "model": _MODEL,
                        "prompt": {"oneOf": [
                            {"type": "string", "minLength": 1},
                            {"type": "array", "items": TOKEN_ID, "minItems": 1},
                            {"type": "array", "minItems": 1, "maxItems": 256, "items": {"oneOf": [
                                {"type": "string", "minLength": 1},
                                {"type": "array", "items": TOKEN_ID, "minItems": 1}]},
                             "description": "a batch of prompts: one choice each (times n), in order"}]},
                        "logprobs": RANGES["logprobs"].json_schema(),
                        "best_of": _BEST_OF,
                        "echo": {"type": "boolean", "description": "the prompt before the completion, in its "
                                 "text and logprobs (then max_tokens may be 0)"},
                        "prompt_logprobs": _PROMPT_LOGPROBS,
                        "suffix": {"enum": [None, ""], "description": "not supported"},
                        "max_completion_tokens": RANGES["max_tokens"].json_schema(),
                        **_SAMPLING,
                        "max_tokens": {**_SAMPLING["max_tokens"], "minimum": 0,
                                       "description": "0 only with echo or prompt_logprobs: the prompt is scored, "
                                                      "nothing generated"}}},
                "ChatCompletionRequest": {
                    "type": "object", "required": ["model", "messages"], "additionalProperties": False,
                    "allOf": [_STREAM_OPTIONS_NEED_STREAM, _ONE_CONSTRAINT, _TOOL_CHOICE_NEEDS_TOOLS, _BEST_OF_ALONE,
                              _only_with("top_logprobs", {"properties": {"logprobs": {"const": True}},
                                                          "required": ["logprobs"]})],
                    "properties": {
                        "model": _MODEL,
                        "messages": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["role"], "properties": {
                                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                                "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
                                    "type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}},
                        "max_completion_tokens": RANGES["max_tokens"].json_schema(),
                        "logprobs": {"type": "boolean"},
                        "top_logprobs": RANGES["logprobs"].json_schema(),
                        **_TOOLS,
                        "prompt_logprobs": {**_PROMPT_LOGPROBS, "description": "vLLM's: top-n logprobs per "
                                            "prompt token, as `prompt_logprobs` in the response"},
                        "echo": {"const": False, "description": "completions only"},
                        "best_of": _BEST_OF,
                        # OpenAI's, taken where they ask for what this server does.
                        "store": {"enum": [None, False], "description": "completions are not stored"},
                        "metadata": {"oneOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}],
                                     "description": "kept only with stored completions: none here"},
                        "service_tier": {"enum": [None, "auto", "default"], "description": "one tier"},
                        "modalities": {"oneOf": [{"type": "null"}, {"const": ["text"]}]},
                        **_SAMPLING}},
            },
        },
    }
