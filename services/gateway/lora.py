"""LoRA adapters at the gateway: served as model names, listed in /v1/models, loaded and
unloaded over the API (admin key), as vLLM serves them.

A request names an adapter as `"base:adapter"` or by the adapter's own name when only one
model serves it; it goes to the base model's replicas with `GenerateRequest.lora` set. The
adapters come from the registry in Redis (shared.adapters), kept current from its
announcements and a periodic re-read. Loading checks the adapter against the base model and
the rank limit its replicas report before anything is written: a bad adapter is refused with
the reason and changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from services.engine.config import EngineArgs
from services.engine.lora import LoRAAdapterError, inspect_adapter
from services.engine.model_config import ModelConfig
from services.gateway.openai_api import ApiError
from services.gateway.utility_api import model_card
from shared import adapters, protocol, registry
from shared.adapters import Adapter
from shared.logging import get_logger

log = get_logger()


class AdapterCatalog:
    """Which adapters each served model has; resolves request model names."""

    def __init__(self, redis, served: Callable[[], dict]):
        self.redis = redis
        self.served = served  # -> served name -> ServedModel (the gateway's current models)
        self.by_model: dict[str, dict[str, Adapter]] = {}

    async def refresh(self, model: str) -> None:
        try:
            self.by_model[model] = await adapters.read(self.redis, model)
        except Exception as exc:  # Redis away: keep serving what we knew
            log.warning("adapter registry unavailable", model=model, error=str(exc))

    async def refresh_all(self) -> None:
        for model in list(self.served()):
            await self.refresh(model)

    async def on_change(self, msg: protocol.LoraAdaptersChanged, _raw) -> None:
        await self.refresh(msg.model)

    def resolve(self, name: str) -> tuple[str, str] | None:
        """(served model, adapter) for an adapter's model name, or None if it names none."""
        base, adapter = adapters.split_model(name)
        if adapter is not None:
            return (base, adapter) if adapter in self.by_model.get(base, {}) else None
        owners = [m for m, served in self.by_model.items() if name in served and m in self.served()]
        if len(owners) > 1:
            raise ApiError(400, f"LoRA adapter '{name}' is served on several models ({', '.join(sorted(owners))}): "
                                f"name it as '<model>:{name}'", "invalid_request_error", "model", "model_not_found")
        return (owners[0], name) if owners else None

    def model_entries(self, max_model_len_of) -> list[dict]:
        """/v1/models entries of every adapter: id, parent (the base model), root (its path) and
        max_model_len: the base's, max_model_len_of(served model) (what its replicas advertise)."""
        served = self.served()
        return [model_card(name, served[model].created, a.path, model, max_model_len_of(served[model]))
                for model, entries in sorted(self.by_model.items()) if model in served
                for name, a in sorted(entries.items())]


class LoraApi:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter: {lora_name, lora_path} as vLLM
    takes them, plus `model` (the base) when the gateway serves more than one model."""

    def __init__(self, catalog: AdapterCatalog, bus, authenticate, deployments, read_json):
        self.catalog, self.bus = catalog, bus
        self.authenticate = authenticate  # request -> ApiKey
        self.read_json = read_json  # request -> the parsed body, within the gateway's body limits
        self.deployments = deployments  # shared.deployments.DeploymentWatcher

    LOAD_FIELDS = frozenset({"lora_name", "lora_path", "model"})
    UNLOAD_FIELDS = frozenset({"lora_name", "model"})

    async def _admin(self, request: web.Request, fields: frozenset[str]) -> dict:
        """The body of an admin request, every field of it one this route honours."""
        key = await self.authenticate(request)
        if not key.admin:
            raise ApiError(403, "loading and unloading LoRA adapters needs an admin key", "permission_error", None,
                           "forbidden")
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ApiError(400, f"unsupported field(s) {', '.join(map(repr, unknown))}: this route takes "
                                f"{', '.join(sorted(fields))}", "invalid_request_error", unknown[0])
        return body

    def _base(self, body: dict) -> str:
        served = self.catalog.served()
        model = body.get("model")
        if model is None:
            if len(served) != 1:
                raise ApiError(400, f"'model' (the base model) is required: this gateway serves {len(served)} "
                                    f"models", "invalid_request_error", "model")
            return next(iter(served))
        if not isinstance(model, str) or model not in served:
            raise ApiError(404, f"the model '{model}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return model

    async def max_lora_rank(self, model: str) -> int:
        """The rank limit adapters of `model` must meet: the lowest its live replicas report, else
        what its deployment spec sets, else the engine default. 0: its replicas serve no adapters."""
        live, _dead = await registry.sweep(self.catalog.redis, model)
        reported = [int(f.get("max_lora_rank", 0) or 0) for f in live.values()]
        if reported:
            return min(reported)
        deployment = self.deployments.deployments.get(model)
        engine = deployment.stable_spec.engine if deployment is not None else {}
        if deployment is not None and not engine.get("enable_lora", False):
            return 0
        return int(engine.get("max_lora_rank", EngineArgs.max_lora_rank))

    async def load(self, request: web.Request) -> web.Response:
        body = await self._admin(request, self.LOAD_FIELDS)
        name, path = body.get("lora_name"), body.get("lora_path")
        why = adapters.check_name(name)
        if why is not None:
            raise ApiError(400, f"lora_name {why}", "invalid_request_error", "lora_name")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "lora_path (the adapter's directory) is required", "invalid_request_error", "lora_path")
        model = self._base(body)
        served = self.catalog.served()
        if name in served:
            raise ApiError(400, f"lora_name '{name}' is the name of a served model", "invalid_request_error",
                           "lora_name")
        await self.catalog.refresh(model)
        current = self.catalog.by_model.get(model, {}).get(name)
        if current is not None and current.path != path:
            raise ApiError(409, f"LoRA adapter '{name}' is already loaded from {current.path}: unload it first",
                           "invalid_request_error", "lora_name", "adapter_exists")
        rank = await self.max_lora_rank(model)
        if rank == 0:
            raise ApiError(400, f"the model '{model}' serves no LoRA adapters (engine argument enable_lora is off)",
                           "invalid_request_error", "model")
        loop = asyncio.get_running_loop()
        try:  # reads only the adapter's config and safetensors header
            await loop.run_in_executor(None, lambda: inspect_adapter(path, ModelConfig.load(served[model].path), rank))
        except LoRAAdapterError as exc:
            raise ApiError(400, f"invalid LoRA adapter: {exc}", "invalid_request_error", "lora_path",
                           "invalid_adapter") from None
        await adapters.put(self.catalog.redis, model, Adapter(name, path, "api"))
        await self.catalog.refresh(model)
        await adapters.announce(self.bus, model, "load", name)
        log.info("lora adapter registered", model=model, adapter=name, path=path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._admin(request, self.UNLOAD_FIELDS)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "lora_name is required", "invalid_request_error", "lora_name")
        model = self._base(body)
        if not await adapters.remove(self.catalog.redis, model, name):
            raise ApiError(404, f"LoRA adapter '{name}' is not loaded for '{model}'", "invalid_request_error",
                           "lora_name", "adapter_not_found")
        await self.catalog.refresh(model)
        await adapters.announce(self.bus, model, "unload", name)
        log.info("lora adapter unregistered", model=model, adapter=name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
