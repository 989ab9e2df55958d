"""The gateway's non-generation OpenAI / vLLM routes, pure (no I/O): `/tokenize` and
`/detokenize` in vLLM's request and response shapes, `/v1/models` entries (vLLM's model card:
root, parent, max_model_len, permission) and `/version`."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from services.gateway import openai_api as oa


def request_model(body: Any) -> str | None:
    """The model a /tokenize or /detokenize body names (None: the gateway's only model)."""
    if not isinstance(body, dict):
        raise oa.bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise oa.bad("'model' must be a non-empty string", "model")
    return model


def tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """vLLM's TokenizeCompletionRequest ({prompt, add_special_tokens=true}) or TokenizeChatRequest
    ({messages, add_generation_prompt=true, continue_final_message=false, add_special_tokens=false}),
    both with return_token_strs=false -> {count, max_model_len, tokens, token_strs}."""
    if ("prompt" in body) == ("messages" in body):
        raise oa.bad("exactly one of 'prompt' or 'messages' is required", "prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise oa.bad("'prompt' must be a string", "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=oa.flag(body, "add_special_tokens", True))
    else:
        # The messages as chat completions take them (the same parsing, the same template).
        _, messages = oa.parse_chat({"model": "-", "messages": body["messages"]})
        generation_prompt = oa.flag(body, "add_generation_prompt", True)
        continue_final = oa.flag(body, "continue_final_message", False)
        if generation_prompt and continue_final:
            raise oa.bad("'continue_final_message' needs 'add_generation_prompt': false", "continue_final_message")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                 continue_final_message=continue_final)
        except Exception as exc:
            raise oa.bad(f"messages cannot be rendered with this model's chat template: {exc}", "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=oa.flag(body, "add_special_tokens", False))
    token_strs = tokenizer.convert_ids_to_tokens(ids) if oa.flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


def detokenize(body: dict, tokenizer, vocab_size: int) -> dict:
    """vLLM's DetokenizeRequest {tokens} -> {prompt}."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise oa.bad("'tokens' must be a list of token ids", "tokens")
    outside = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise oa.bad(f"token id {outside} is outside the vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def model_card(model_id: str, created: int, root: str, parent: str | None, max_model_len: int | None,
               **extra) -> dict:
    """A /v1/models entry as vLLM writes it."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "strata", "root": root,
            "parent": parent, "max_model_len": max_model_len,
            "permission": [{"id": f"modelperm-{model_id}", "object": "model_permission", "created": created,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}], **extra}


def model_not_found(model_id: str) -> oa.ApiError:
    """OpenAI's 404 for an unknown model (the id echoed bounded)."""
    shown = model_id if len(model_id) <= 64 else model_id[:64] + "..."
    return oa.ApiError(404, f"The model `{shown}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")


def version() -> dict:
    try:
        return {"version": metadata.version("strataserve")}
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return {"version": "unknown"}
