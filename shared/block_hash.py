"""KV block hashes: one definition shared by the engines and the router.

A full block's hash chains its parent's hash with the block's token ids, so equal hashes mean
equal prefixes. blake2b (not Python's salted hash()) makes it identical in every process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # parent of the first block of the base model's requests


def adapter_root_hash(adapter: str | None) -> int:
    """Parent of the first block of a LoRA adapter's requests (ROOT_HASH for the base model):
    the adapter's name enters every block's hash, so two adapters (or an adapter and the base
    model) never share KV, and the router computes the same chain from the request."""
    if not adapter:
        return ROOT_HASH
    digest = hashlib.blake2b(b"strata-lora\0" + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Unsigned 64-bit hash of one block given its parent's hash."""
    h = hashlib.blake2b(struct.pack("<Q", parent_hash), digest_size=8)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))  # fixed width and byte order
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of token_ids, in order (a partial last block has none);
    `root`: adapter_root_hash of the request's adapter."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
