"""A model directory's weights, read tensor by tensor from its safetensors files.

Sharded checkpoints are found through `model.safetensors.index.json` (so a directory that also
holds another copy, such as Mistral's consolidated.safetensors, is not read twice). Files are
memory-mapped; each tensor is read and converted to the engine's dtype and device on its own,
so loading a bf16 checkpoint into fp32 never holds a second full copy of the model. Names are
accepted with and without the `model.` prefix (checkpoints saved from the bare decoder).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).exists()]
            if missing:
                raise ValueError(f"{self.path}: {INDEX_FILE} names missing shards: {', '.join(missing)}")
        elif (self.path / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path}: no .safetensors files")
        self._files = {name: safe_open(str(self.path / name), framework="pt") for name in files}
        self._where: dict[str, str] = {}
        for name, handle in self._files.items():
            for key in handle.keys():
                self._where[key] = name

    def names(self) -> list[str]:
        return list(self._where)

    def _resolve(self, name: str) -> str | None:
        """`name` as the checkpoint spells it: with the `model.` prefix or without."""
        if name in self._where:
            return name
        bare = name.removeprefix("model.")
        if bare in self._where:
            return bare
        return None

    def has(self, name: str) -> bool:
        return self._resolve(name) is not None

    def get(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor, converted; raises ValueError naming the weight if it is missing."""
        key = self._resolve(name)
        if key is None:
            raise ValueError(f"{self.path}: weight {name!r} not found in the checkpoint")
        tensor = self._files[self._where[key]].get_tensor(key)
        return tensor.to(device=device, dtype=dtype or tensor.dtype).contiguous()

    def fused(self, names: list[str], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Tensors concatenated along dim 0 into one buffer, filled one source at a time."""
        shapes = [self._shape(n) for n in names]
        rows = sum(s[0] for s in shapes)
        out = torch.empty((rows, *shapes[0][1:]), dtype=dtype, device=device)
        start = 0
        for name, shape in zip(names, shapes):
            out[start:start + shape[0]].copy_(self.get(name))
            start += shape[0]
        return out

    def _shape(self, name: str) -> list[int]:
        key = self._resolve(name)
        if key is None:
            raise ValueError(f"{self.path}: weight {name!r} not found in the checkpoint")
        return list(self._files[self._where[key]].get_slice(key).get_shape())
