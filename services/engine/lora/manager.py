"""LoRA adapters in an engine: registered by name, cached on the host, resident in device slots.

- registered: name -> adapter directory (checked against the base model when registered).
- host cache: up to `max_cpu_loras` adapters read into the engine's layout (LRU). An adapter
  that waiting or running requests use is pinned there; more may be held while that many are
  in use.
- device slots: `max_loras` slots per fused linear layer (`a_stack`/`b_stack`, see
  services.engine.lora.adapter). The engine's scheduler admits a request only once its adapter
  has a slot (`can_schedule`): a free one, or the least recently used one that no running
  request needs. So a batch never holds more than max_loras adapters, and making an adapter
  resident is one host-to-device copy inside a step: reading from disk happens when a request
  arrives, on the caller's thread (`acquire`, `prefetch`), never in the step loop.

Threads: `register`, `unregister`, `prefetch` and `acquire` run on callers' threads; slots,
`can_schedule`, `release` and `take_retired` on the engine thread. One lock guards the
registry, the host cache and the reference counts.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from pathlib import Path

import torch

from services.engine.lora.adapter import AdapterInfo, LoRAAdapterError, LoRAWeights, inspect_adapter, \
    linear_slices, load_adapter
from services.engine.lora.layers import LoRABatch, LoRALinear
from services.engine.model_config import ModelConfig
from shared.block_hash import adapter_root_hash

NO_SLOT = -1


class LoRAManager:
    def __init__(self, model, config: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, use_triton: bool = False):
        self.config, self.dtype, self.device = config, dtype, device
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.batch = LoRABatch(device, use_triton, max_loras, dtype)
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(model.layers):
            for linear, (fan_in, outs) in linear_slices(config).items():
                rows = len(outs) * max_lora_rank
                a = torch.zeros((max_loras, rows, fan_in), dtype=dtype, device=device)
                b = torch.zeros((max_loras, rows, sum(outs)), dtype=dtype, device=device)
                self.stacks[(i, linear)] = (a, b)
                setattr(layer, linear, LoRALinear(getattr(layer, linear), a, b, self.batch, outs))
        self._lock = threading.Lock()
        self.registered: dict[str, Path] = {}
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.refs: Counter[str] = Counter()  # requests (waiting or running) per adapter
        self._retiring: set[str] = set()  # unregistered while requests still use them
        self._retired: list[str] = []  # gone: their slots and cached KV are dropped by the engine thread
        self.slots: list[str | None] = [None] * max_loras
        self._slot_of: dict[str, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self.loads = 0  # adapters made resident in a device slot
        self.evictions = 0  # resident adapters replaced by another
        self.disk_loads = 0  # adapters read from disk into the host cache

    @property
    def slot_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.stacks.values())

    # ---- registry (callers' threads) --------------------------------------------------------
    def register(self, name: str, path: str | Path) -> AdapterInfo:
        """Check an adapter and serve it under `name`; LoRAAdapterError if it cannot serve here.
        Registering the same name and path again is a no-op."""
        if not name or ":" in name:
            raise LoRAAdapterError(f"adapter name {name!r} must be non-empty and contain no ':'")
        path = Path(path).expanduser().resolve()
        with self._lock:
            current = self.registered.get(name)
            if current is not None and current != path:
                raise LoRAAdapterError(f"adapter {name!r} is already loaded from {current}; unload it first")
        info = inspect_adapter(path, self.config, self.max_lora_rank)
        with self._lock:
            self.registered[name] = path
            self._retiring.discard(name)
        return info

    def unregister(self, name: str) -> bool:
        """Stop serving `name`: new requests are refused at once; requests already using it
        finish on it, then its weights and cached KV blocks go. False if it was not served."""
        with self._lock:
            if self.registered.pop(name, None) is None:
                return False
            if self.refs[name]:
                self._retiring.add(name)
            else:
                self._retire(name)
        return True

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.registered)

    def path_of(self, name: str) -> Path | None:
        with self._lock:
            return self.registered.get(name)

    def prefetch(self, name: str) -> None:
        """Read a registered adapter into the host cache now (off the step loop)."""
        self._host_weights(name, pin=False)

    def acquire(self, name: str) -> None:
        """A request will use `name`: pinned in the host cache until release(). Raises
        LoRAAdapterError for an adapter that is not served or cannot be read."""
        self._host_weights(name, pin=True)

    def _host_weights(self, name: str, pin: bool) -> LoRAWeights:
        with self._lock:
            path = self.registered.get(name)
            if path is None:
                raise LoRAAdapterError(f"LoRA adapter {name!r} is not loaded"
                                       + (f" (loaded: {', '.join(sorted(self.registered))})" if self.registered else ""))
            weights = self.host.get(name)
            if weights is not None:
                self.host.move_to_end(name)
                self.refs[name] += pin
                return weights
        weights = load_adapter(name, path, self.config, self.max_lora_rank, self.dtype)  # disk: outside the lock
        with self._lock:
            if self.registered.get(name) != path:  # unloaded (or replaced) meanwhile
                raise LoRAAdapterError(f"LoRA adapter {name!r} was unloaded")
            weights = self.host.setdefault(name, weights)
            self.host.move_to_end(name)
            self.disk_loads += 1
            self.refs[name] += pin
            self._trim_host()
        return weights

    def _trim_host(self) -> None:
        """Drop least recently used host copies beyond max_cpu_loras that no request holds
        and that are not resident (a resident adapter's host copy re-fills its slot cheaply)."""
        excess = len(self.host) - self.max_cpu_loras
        for name in list(self.host):
            if excess <= 0:
                break
            if not self.refs[name] and name not in self._slot_of:
                del self.host[name]
                excess -= 1

    def _retire(self, name: str) -> None:  # with the lock held
        self._retiring.discard(name)
        self.host.pop(name, None)
        self._retired.append(name)

    # ---- the engine thread ------------------------------------------------------------------
    def release(self, name: str) -> None:
        """A request that used `name` finished or was aborted."""
        with self._lock:
            self.refs[name] -= 1
            if self.refs[name] <= 0:
                del self.refs[name]
                if name in self._retiring:
                    self._retire(name)
                self._trim_host()

    def take_retired(self) -> list[int]:
        """Adapters gone since the last call: their slots are freed here; returns their block
        hash roots, whose cached KV blocks the engine drops (a later adapter of the same name
        must not find them)."""
        with self._lock:
            retired, self._retired = self._retired, []
        for name in retired:
            slot = self._slot_of.pop(name, None)
            if slot is not None:
                self.slots[slot] = None
                self._slot_lru.move_to_end(slot, last=False)  # reused first
        return [adapter_root_hash(name) for name in retired]

    def slot(self, name: str | None) -> int:
        """The device slot of a resident adapter; NO_SLOT for the base model."""
        return NO_SLOT if name is None else self._slot_of[name]

    def can_schedule(self, seq, running) -> bool:
        """The engine scheduler's admission check: seq's adapter has (or now gets) a device slot."""
        name = seq.lora_name
        if name is None:
            return True
        if name in self._slot_of:
            self._slot_lru.move_to_end(self._slot_of[name])
            return True
        busy = {s.lora_name for s in running if s.lora_name is not None}
        for slot in self._slot_lru:  # least recently used first
            if self.slots[slot] not in busy:
                self._fill(slot, name)
                return True
        return False

    def _fill(self, slot: int, name: str) -> None:
        with self._lock:
            weights = self.host.get(name)
        if weights is None:  # acquire() pinned it; only a bug gets here
            raise RuntimeError(f"LoRA adapter {name!r} has no host copy")
        previous = self.slots[slot]
        if previous is not None:
            del self._slot_of[previous]
            self.evictions += 1
        for key, (a, b) in self.stacks.items():
            pair = weights.linears.get(key)
            if pair is None:
                a[slot].zero_()
                b[slot].zero_()
            else:
                a[slot].copy_(pair[0], non_blocking=True)
                b[slot].copy_(pair[1], non_blocking=True)
        self.slots[slot] = name
        self._slot_of[name] = slot
        self._slot_lru.move_to_end(slot)
        self.loads += 1
        with self._lock:
            self._trim_host()

    def set_batch(self, token_slots: list[tuple[int, int]]) -> None:
        """This step's tokens in model order, as (slot, number of tokens) per sequence."""
        self.batch.set(token_slots)

    def stats(self) -> dict:
        with self._lock:
            return {"lora_resident": sorted(n for n in self.slots if n is not None),
                    "lora_cached": sorted(self.host), "lora_registered": sorted(self.registered),
                    "lora_loads": self.loads, "lora_evictions": self.evictions, "lora_disk_loads": self.disk_loads}
